"""docs/api.md quotes the static rejection reasons as exact text (policy item 5): each quoted
template, filled in with its request and config, is what ``take_rejected()`` reports."""

from __future__ import annotations

import re
from pathlib import Path

from support import make_driver, prompt, sp

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BS = 4


def documented_reasons() -> list[str]:
    """The quoted ``"unschedulable: ..."`` templates of docs/api.md's item 5, a line break read
    as one space (as the page says)."""
    text = API_MD.read_text()
    start = text.index("5. Rejection reasons (exact text")
    item = text[start:text.index("\n## ", start)]
    flat = re.sub(r"\s*\n\s*", " ", item)
    return re.findall(r'`"(unschedulable: [^"`]*)"`', flat)


def test_the_documented_rejection_texts_are_the_schedulers():
    templates = documented_reasons()
    assert len(templates) == 3, templates
    too_long, over_budget, pool = templates
    d = make_driver(num_blocks=6, block_size=BS, max_model_len=24, enable_chunked_prefill=False,
                    max_num_batched_tokens=16)
    cfg = d.cfg
    assert cfg is not None
    d.add(0, prompt(25), sp())  # > max_model_len
    d.add(1, prompt(17), sp())  # > max_num_batched_tokens, chunking off
    d.add(2, prompt(3), sp(max_tokens=1))
    d.schedule()
    small = make_driver(num_blocks=4, block_size=BS, max_model_len=64)
    small.add(3, prompt(13), sp())  # 4 blocks > the pool's 3
    small.schedule()
    fields = dict(max_model_len=cfg.max_model_len,
                  max_num_batched_tokens=cfg.max_num_batched_tokens)
    assert d.rejected == {0: too_long.format(n=25, **fields),
                          1: over_budget.format(n=17, **fields)}
    assert small.rejected == {3: pool.format(n=13, nb=4, T=3, num_blocks=4)}
    # Every documented field was filled in: no brace left.
    assert not any("{" in r or "}" in r for r in [*d.rejected.values(),
                                                   *small.rejected.values()])
