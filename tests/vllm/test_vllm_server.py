"""vLLM's OpenAI-compatible server with ``--scheduler-cls atom_sched.vllm.AtomScheduler`` answers
the ``openai`` client with the tokens vLLM's own scheduler gives (the engine core runs in its own
process here, as it does by default, so the class is loaded by its qualified name there).

Needs the venv of scripts/vllm_venv.sh; about a minute on two cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_vllm_e2e as e2e  # noqa: E402
import vllm_run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = vllm_run.model_path()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # `vllm serve` itself asks importlib.metadata for a distribution named "vllm", which the
    # CPU build (distribution "vllm-cpu") is not: the module entry point avoids that lookup.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--scheduler-cls", vllm_run.ATOM, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--dtype", "float32",
           *[x for k, v in e2e.PREFIX_CHUNKED.items()
             for x in ([f"--{k.replace('_', '-')}"] if v is True else
                       [f"--{k.replace('_', '-')}", str(v)])]]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited ({proc.returncode}):\n"
                                     f"{log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not up in 600 s:\n{log_path.read_text()[-6000:]}")
            time.sleep(1)
        yield SimpleServer(port, model, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class SimpleServer:
    def __init__(self, port: int, model: str, log_path: Path) -> None:
        self.port, self.model, self.log_path = port, model, log_path

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                             max_retries=0, timeout=300)


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": vllm_run.SYSTEM},
            {"role": "user", "content": vllm_run.QUESTIONS[i]}]


def test_openai_client_gets_vllms_answers(server):
    theirs = e2e.run("vllm", e2e.PREFIX_CHUNKED)["outputs"]
    client = server.client()
    # Greedy, with vLLM's default stop rules: the EOS-stopped answer and the length-capped one.
    for i in (1, 3):
        sp = e2e.SAMPLING[i]
        resp = client.chat.completions.create(
            model=server.model, messages=_messages(i), temperature=0.0,
            max_tokens=sp["max_tokens"])
        choice = resp.choices[0]
        assert choice.message.content == theirs[i]["text"], f"question {i}"
        assert choice.finish_reason == theirs[i]["finish_reason"]
        assert resp.usage.completion_tokens == len(theirs[i]["token_ids"])
    # Streaming, with a stop token id (vLLM's extension of the API).
    sp = e2e.SAMPLING[2]
    stream = client.chat.completions.create(
        model=server.model, messages=_messages(2), temperature=0.0, max_tokens=sp["max_tokens"],
        stream=True, extra_body={"stop_token_ids": sp["stop_token_ids"]})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == theirs[2]["text"] and finish == "stop"
    log = server.log_path.read_text()
    assert "atom_sched scheduler:" in log  # our class built the engine core's scheduler


def test_a_request_the_scheduler_refuses_fails_alone_and_the_server_keeps_serving(server):
    """A client's cache_salt of 100 characters, which vLLM's frontend lets through (at most 128
    characters), is 300 bytes of UTF-8, more than the core's 256: it must end only that request,
    since raising inside the engine core's loop would stop the server for every client."""
    client = server.client()
    try:
        resp = client.chat.completions.create(
            model=server.model, messages=_messages(1), temperature=0.0, max_tokens=8,
            extra_body={"cache_salt": "\u20ac" * 100})
    except openai.APIError as e:  # the frontend turns the error finish into an error reply
        refused = str(e)
    else:
        refused = resp.choices[0].finish_reason
        assert not resp.choices[0].message.content
    print(f"refused request: {refused}")
    resp = client.chat.completions.create(model=server.model, messages=_messages(0),
                                          temperature=0.0, max_tokens=8)
    assert resp.choices[0].message.content and resp.usage.completion_tokens == 8
    log = server.log_path.read_text()
    assert "cache_salt" in log and "not served" in log
