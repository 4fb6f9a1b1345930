"""pytest plugin: vLLM 0.32.0's own scheduler tests against atom_sched.vllm.AtomScheduler.

scripts/vllm_upstream_tests.sh extracts vLLM's tests/v1/core tests from its sdist and runs them
with ``-p atom_upstream`` (a plugin, not a conftest, so that ``pytest tests/vllm`` leaves it
alone). Every scheduler the tests build through ``create_scheduler()`` (and the priority,
encoder-decoder and hybrid helpers of test_scheduler.py, which construct ``Scheduler`` directly)
is an ``AtomScheduler``. ``ATOM_UPSTREAM_SCHEDULER=vllm`` runs the same tests on vLLM's own
scheduler instead: the control run, which shows the tests themselves pass in this environment.

EXPECTED below is the one list of the tests that do not pass against the class, each with its
reason (docs/vllm.md "vLLM's own scheduler tests" groups them). They are strict xfails, so a test
that starts passing fails the run until it is taken off the list; "refused" ones must fail with
the class's UnsupportedFeature, nothing else.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections import Counter
from unittest import mock

import pytest

MODE = os.environ.get("ATOM_UPSTREAM_SCHEDULER", "atom")
if MODE not in ("atom", "vllm"):
    raise ValueError(f"ATOM_UPSTREAM_SCHEDULER={MODE!r}: 'atom' or 'vllm'")

S = "test_scheduler.py::"
A = "test_async_scheduler.py::"
P = "test_prefix_caching.py::"

# kind: "refused"  AtomScheduler refuses the feature (UnsupportedFeature) when it is built or
#                  given the request: strict xfail that must raise UnsupportedFeature;
#       "unserved" a request the class does not serve (it ends with an error, never raised
#                  inside vLLM's engine loop): strict xfail;
#       "whitebox" the test reads or drives vLLM's Scheduler internals (kv_cache_manager,
#                  private methods, requests injected into running) or attaches a component the
#                  class refuses by hand: strict xfail;
#       "policy"   a documented policy difference (docs/vllm.md "What differs"): strict xfail;
#       "notours"  a unit test of vLLM's own class (built with object.__new__, its internals
#                  mocked): skipped here, it runs in the control run;
#       "offline"  cannot run here, for either scheduler: skip.
# The first matching entry decides.
# Patterns (fnmatch) match "file::test" and "file::test[params]".
EXPECTED: list[tuple[str, str, str]] = [
    # ---- cannot run offline, for either scheduler ----
    (S + "test_schedule_multimodal_requests", "offline", "llava model config (multimodal)"),
    (S + "test_schedule_partial_requests", "offline", "llava model config (multimodal)"),
    (S + "test_encoder_only_prompt_longer_than_budget_is_chunked", "offline",
     "llava model config (multimodal)"),
    (S + "test_same_step_duplicate_encoder_input_stays_cached", "offline",
     "llava model config (multimodal)"),
    (S + "test_no_mm_input_chunking*", "offline", "llava model config (multimodal)"),
    # (all but test_ec_connector_pending_prefetch_only_checks_future_mm_features, model-free)
    (S + "test_ec_connector_[!p]*", "offline", "llava model config (multimodal, EC connector)"),
    (S + "test_priority_scheduling_ec_connector_*", "offline",
     "llava model config (multimodal, EC connector)"),
    (S + "test_eagle3_mm_encoder_cache_with_shift", "offline", "llava model config (multimodal)"),
    (S + "test_free_encoder_inputs_*", "offline", "llava model config (multimodal)"),
    (S + "test_unavailable_encoder_input_*", "offline", "llava model config (multimodal)"),
    (S + "test_encoder_cache_*", "offline", "llava model config (multimodal)"),
    (A + "test_abort_request_when_structured_output_fsm_cannot_advance", "notours",
     "object.__new__(AsyncScheduler) with mocked internals"),
    (S + "test_abort_request_when_structured_output_fsm_cannot_advance", "notours",
     "object.__new__(Scheduler) with mocked internals"),
    # ---- features refused at construction or add_request ----
    (S + "test_async_scheduling_pp_*", "refused", "pipeline parallelism"),
    (A + "test_no_spec_decode_padding_up_to_max_model_len", "whitebox",
     "sets num_computed_tokens on a request before add_request (a disaggregated decode's "
     "state, which the class takes from a KV connector)"),
    (A + "test_kv_pressure_preemption_with_inflight_output[[]3]", "whitebox",
     "wraps the private _preempt_request"),
    (A + "test_reset_prefix_cache_with_inflight_output_under_kv_pressure*", "whitebox",
     "wraps the private _preempt_request"),
    (A + "test_resumable_request_handoff", "policy",
     "three steps in flight (a batch queue of 3: the core keeps at most two), and a session's "
     "next turn scheduled while its last turn's rows are still in flight (the core resumes it "
     "once they land)"),
    (S + "test_diffusion_scheduler_is_selected_by_default*", "refused",
     "diffusion language models (vLLM's DiffusionScheduler)"),
    (S + "test_pooling_*", "refused", "pooling models"),
    (S + "test_spec_decode_padding_dropped_when_recurrent_alignment_clips", "whitebox",
     "calls the private _mamba_block_aligned_split (Mamba alignment)"),
    (S + "test_scheduler_*_connector_stats", "whitebox",
     "update_from_output of a SchedulerOutput the class never produced, with connector stats"),
    (S + "test_kv_connector_*[[]True-ec_consumer*", "refused",
     "encoder-cache connectors (the ec_consumer cases)"),
    (S + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[[]True-ec_consumer*",
     "refused", "encoder-cache connectors (the ec_consumer cases)"),
    (S + "test_kv_connector_basic", "whitebox", "reads kv_cache_manager"),
    (S + "test_kv_connector_records_external_cache_hit_sources", "whitebox",
     "reads kv_cache_manager"),
    (S + "test_kv_connector_unable_to_allocate", "whitebox", "reads kv_cache_manager"),
    (S + "test_kv_connector_handles_preemption", "whitebox",
     "reads kv_cache_manager and kv_holding_waiting"),
    (S + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv", "whitebox",
     "reads kv_holding_waiting (vLLM's blocked-request queue)"),
    (S + "test_throttle_prefills_*_remote_kv*", "whitebox",
     "reads kv_holding_waiting (vLLM's blocked-request queue)"),
    (S + "test_prefix_cache_query_not_inflated_by_connector_defer", "whitebox",
     "reads kv_cache_manager"),
    (S + "test_external_prefix_cache_metrics[[]True-False]", "whitebox",
     "hands SchedulerOutputs back out of order (update_from_output takes the oldest)"),
    (S + "test_external_prefix_cache_metrics[[]*-True]", "whitebox",
     "reads kv_holding_waiting (vLLM's blocked-request queue)"),
    (S + "test_prepend_skipped_requests_order", "whitebox",
     "drives vLLM's request queues (remove_requests)"),
    (S + "test_abort_request_finished_recving", "whitebox",
     "reads finished_recving_kv_req_ids"),
    (S + "test_abort_request_waiting_for_remote_kvs", "policy",
     "a request aborted while its KV arrives leaves `requests` at once (the core keeps its "
     "blocks until the receive is reported)"),
    (S + "test_delayed_kv_connector_free_keeps_scheduler_active", "whitebox",
     "puts a finished request into `requests` by hand"),
    (S + "test_async_load_reservation_prevents_wedge_e2e", "whitebox",
     "reads kv_cache_manager"),
    (P + "test_hisparse_async_admission_requires_full_prompt_host_pages", "whitebox",
     "attaches a HiSparse KV connector by hand (reads scheduler_reserve_full_isl)"),
    (P + "test_hisparse_admitted_async_loads_can_finish_with_nothing_running", "whitebox",
     "attaches a HiSparse KV connector by hand (reads scheduler_reserve_full_isl)"),
    (A + "test_kv_pressure_preempt_mid_handoff*", "whitebox",
     "reads requires_kv_delivery (a KV connector's property of vLLM's Scheduler)"),
    (S + "test_encoder_input_skipped_when_connector_already_has_the_item", "refused",
     "encoder-cache connectors, multimodal models"),
    (S + "test_encoder_instance_*", "refused", "multimodal models (encoder-only instance)"),
    (S + "test_mamba_align_*", "whitebox",
     "calls the private _mamba_block_aligned_split (Mamba alignment, multimodal inputs)"),
    (S + "test_*cross_attn*", "refused", "encoder-decoder models (two KV-cache groups)"),
    (S + "test_hybrid_*", "refused", "hybrid KV caches (several KV-cache groups)"),
    (S + "test_pause_new_ignores_streaming_session_waiting_for_input", "whitebox",
     "reads kv_holding_waiting (vLLM's blocked-request queue)"),
    (S + "test_fcfs_mixed_blocked_types_remote_load_drains_first", "whitebox",
     "reads deferred_waiting and kv_holding_waiting (vLLM's blocked-request queues; KV "
     "connectors)"),
    (S + "test_remote_kv_promotion_drains_before_grammar_prefix", "whitebox",
     "reads kv_holding_waiting (vLLM's blocked-request queues; KV connectors)"),
    # ---- white-box: vLLM's Scheduler internals, or a refused component attached by hand ----
    (S + "test_make_scheduled_encoder_input_stats_output_embeddings", "whitebox",
     "calls the private _make_scheduled_encoder_input_stats (multimodal)"),
    (S + "test_scheduled_encoder_input_stats_disabled_*", "whitebox",
     "patches the private _make_scheduled_encoder_input_stats (multimodal)"),
    (S + "test_routed_experts_prompt_start_at_prompt_end", "whitebox",
     "attaches an aux-output (routed experts) connector by hand; the class refuses them"),
    (S + "test_finish_request", "whitebox",
     "asserts on an aux-output connector attached by hand; the class refuses them"),
    (S + "test_pending_hisparse_reclamation*", "whitebox",
     "attaches a HiSparse KV connector by hand; the class refuses connectors"),
    (S + "test_cached_request_data_resumed_all_token_ids_mrv1_only", "whitebox",
     "calls the private _make_cached_request_data"),
    (S + "test_update_from_output_routes_*sampling_mask*", "whitebox",
     "injects requests into scheduler.requests/running without schedule() (the masks are "
     "passed through: tests/vllm/test_vllm_e2e.py)"),
    (S + "test_preemption_re_records_prefix_cache_query", "whitebox",
     "reads kv_cache_manager (vLLM's KVCacheManager)"),
    (S + "test_prefix_cache_stats_*", "whitebox", "reads kv_cache_manager"),
    (S + "test_aux_output_reset_follows_kv_reset_result", "whitebox",
     "patches kv_cache_manager; aux-output connector attached by hand"),
    (S + "test_kv_cache_release_after_keep_pause_preserves_requests", "whitebox",
     "reads kv_cache_manager"),
    (S + "test_preemption_processes_stale_aux_output", "whitebox",
     "calls the private _preempt_request; aux-output connector attached by hand"),
    (S + "test_scheduler_stats_waiting_queues", "whitebox",
     "sets requests to WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR by hand and reads deferred_waiting "
     "(vLLM's queue of requests whose grammar is compiling)"),
    (A + "test_kv_pressure_preemption_with_inflight_output[[]0]", "whitebox",
     "calls the private _preempt_request"),
    (A + "test_requires_kv_delivery_defaults_to_producer_role", "whitebox",
     "reads requires_kv_delivery (a KV connector's property of vLLM's Scheduler)"),
    (S + "test_stop_via_update_from_output", "whitebox",
     "update_from_output of a SchedulerOutput the test built, never scheduled by the class "
     "(a ValueError: the class takes back only its oldest outstanding output)"),
    (S + "test_schedule_skip_tokenizer_init_structured_output_request", "whitebox",
     "reads deferred_waiting (vLLM's queue of requests whose grammar is compiling)"),
    (S + "test_memory_leak", "whitebox",
     "its leak check reads kv_cache_manager and encoder_cache_manager (the run before it "
     "passes)"),
    (S + "test_spec_decode_padding_skipped_for_diffusion", "whitebox",
     "sets num_sampled_tokens_per_step, an internal of vLLM's diffusion scheduler, on a built "
     "scheduler (diffusion models are refused)"),
    # ---- documented policy differences ----
    (S + "test_scheduler_reset_prefix_cache", "policy",
     "reset_prefix_cache(reset_running_requests=True) with a batch still in flight: the class "
     "answers False until its output lands (vLLM drops it); also an aux-output connector mock"),
]

_built: Counter = Counter()  # scheduler classes the current test constructed
_tally: Counter = Counter()  # (outcome, classes built) over the session
_used: set[str] = set()  # EXPECTED patterns that matched a collected test


def _expectation(nodeid: str) -> tuple[str, str, str] | None:
    name = nodeid.rsplit("/", 1)[-1]
    base = name.split("[", 1)[0]
    for entry in EXPECTED:
        if fnmatch.fnmatchcase(name, entry[0]) or fnmatch.fnmatchcase(base, entry[0]):
            return entry
    return None


def _wrap_create_scheduler(orig):
    from atom_sched.vllm import AtomScheduler

    def create_scheduler(*args, scheduler_cls=None, **kwargs):
        if MODE != "atom":
            return orig(*args, scheduler_cls=scheduler_cls, **kwargs)
        if scheduler_cls is not None:
            pytest.skip(f"tests vLLM's own {scheduler_cls.__name__} (passed as "
                        "scheduler_cls), not the scheduler under test")
        if not kwargs.get("async_scheduling"):
            return orig(*args, scheduler_cls=AtomScheduler, **kwargs)
        # The test wants vLLM's AsyncScheduler behaviour. vLLM's CPU platform turns
        # scheduler_config.async_scheduling off while the config is built (a GPU keeps it, and
        # the class reads it there), so it is set again just before the class reads it.
        init = AtomScheduler.__init__

        def init_async(self, vllm_config, *a, **k):
            vllm_config.scheduler_config.async_scheduling = True
            init(self, vllm_config, *a, **k)

        with mock.patch.object(AtomScheduler, "__init__", init_async):
            return orig(*args, scheduler_cls=AtomScheduler, **kwargs)

    create_scheduler.__wrapped__ = orig
    return create_scheduler


def _count_constructions() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_sched.vllm import AtomScheduler

    for cls, name in ((AtomScheduler, "atom"), (Scheduler, "vllm")):
        init = cls.__init__

        def counted(self, *a, _init=init, _name=name, **k):
            _built[_name] += 1
            return _init(self, *a, **k)

        cls.__init__ = counted


def pytest_configure(config):
    for marker in ("cpu_test", "skip_global_cleanup", "core_model", "slow_test"):
        config.addinivalue_line("markers", f"{marker}: vLLM's test marker")
    _count_constructions()


def pytest_collection_modifyitems(config, items):
    from atom_sched.vllm import UnsupportedFeature

    for item in items:
        entry = _expectation(item.nodeid)
        if entry is None:
            continue
        pattern, kind, reason = entry
        if kind == "offline" or (kind == "notours" and MODE == "atom"):
            _used.add(pattern)
            item.add_marker(pytest.mark.skip(reason=f"{kind}: {reason}"))
        elif MODE == "atom":
            _used.add(pattern)
            raises = UnsupportedFeature if kind == "refused" else None
            item.add_marker(pytest.mark.xfail(strict=True, raises=raises,
                                              reason=f"{kind}: {reason}"))
    unused = [p for p, kind, _ in EXPECTED if p not in _used and (MODE == "atom"
                                                                  or kind == "offline")]
    if unused and len(items) > 300:  # only a full run can tell a stale entry
        raise pytest.UsageError(f"EXPECTED entries that match no test: {unused}")


@pytest.fixture(autouse=True)
def _atom_scheduler(request, monkeypatch):
    utils = sys.modules.get("tests.v1.core.utils")
    if utils is not None:
        orig = getattr(utils.create_scheduler, "__wrapped__", utils.create_scheduler)
        wrapped = _wrap_create_scheduler(orig)
        monkeypatch.setattr(utils, "create_scheduler", wrapped)
        if getattr(request.module, "create_scheduler", None) is orig:
            monkeypatch.setattr(request.module, "create_scheduler", wrapped)
    if MODE == "atom" and request.module.__name__ == "tests.v1.core.test_scheduler":
        # Its own helpers (create_scheduler_with_priority, the encoder-decoder and hybrid ones)
        # construct the module's Scheduler directly; elsewhere the name is only an annotation
        # (and object.__new__(Scheduler) in a structured-output test).
        from atom_sched.vllm import AtomScheduler

        monkeypatch.setattr(request.module, "Scheduler", AtomScheduler)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _built.clear()  # before any skip or fixture of this test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        built = "+".join(sorted(k for k, v in _built.items() if v)) or "none"
        if hasattr(report, "wasxfail"):
            kind = "xfailed" if report.skipped else "xpassed"
        else:
            kind = report.outcome
        _tally[(kind, built)] += 1
        item.user_properties.append(("built", built))


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section(f"scheduler classes the tests built (ATOM_UPSTREAM_SCHEDULER={MODE})")
    tr.write_line("built: atom = AtomScheduler, vllm = vLLM's Scheduler, none = no scheduler "
                  "(tests of vLLM's KV cache manager, block pool, hashing)")
    for (kind, built), n in sorted(_tally.items()):
        tr.write_line(f"{kind:8} {n:4}  built: {built}")
