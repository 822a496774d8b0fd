"""What the expert tier learns while a model runs (routing statistics, the learned CPU share) is kept per model and
read back at the next load, so the VRAM cache starts warm (issue 10: "a pinned hot set loaded from routing
statistics persisted per model from earlier runs"). The engine takes a `state_dir`; the service writes at unload,
at a model swap, at stop and once a minute while idle; the app and `freetoken serve` give each package its own
folder under the data folder."""
from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest

from runtime.engine import Engine, SamplingParams
from runtime.experts.hybrid import HybridExperts, hybrid_experts_factory
from tests.engine_fixtures import ftw_packages  # noqa: F401  (session fixture)

PROMPT = [3, 17, 42, 5, 99, 7, 64, 12]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])


def _hybrid(path, state_dir=None):
    factory = functools.partial(hybrid_experts_factory, slots=6)
    return Engine.load(path, device="cpu", experts_factory=factory, state_dir=state_dir)


def test_a_model_reloaded_with_its_state_folder_starts_with_its_hot_experts_pinned(ftw_packages, tmp_path):
    path = ftw_packages("qwen3_moe", "int4")
    first = _hybrid(path, tmp_path / "state")
    tier = first.model.experts
    assert isinstance(tier, HybridExperts) and not tier.options.hot_set          # nothing learned yet: cold
    want = first.generate(PROMPT, GREEDY).tokens
    assert first.save_learned_state()
    saved = json.loads((tmp_path / "state" / "routing.json").read_text())
    assert saved["version"] == 1 and sum(c for _, _, c in saved["counts"]) > 0
    counts = {(layer, e): c for layer, e, c in saved["counts"]}

    again = _hybrid(path, tmp_path / "state")
    hot = again.model.experts.options.hot_set
    assert hot and set(hot) <= set(counts)                                  # the most used experts, pinned
    assert min(counts[k] for k in hot) >= max(c for k, c in counts.items() if k not in hot)
    assert again.generate(PROMPT, GREEDY).tokens == want                    # warm, and the same answer


def test_without_a_state_folder_or_with_every_expert_resident_nothing_is_written(ftw_packages, tmp_path):
    path = ftw_packages("qwen3_moe", "int4")
    assert not _hybrid(path).save_learned_state()
    resident = Engine.load(path, device="cpu", state_dir=tmp_path / "state")     # the CPU default: resident
    resident.generate(PROMPT, GREEDY)
    assert not resident.save_learned_state() and not (tmp_path / "state").exists()


def test_a_damaged_statistics_file_starts_cold_and_is_replaced(ftw_packages, tmp_path, caplog):
    path = ftw_packages("qwen3_moe", "int4")
    state = tmp_path / "state"
    state.mkdir()
    (state / "routing.json").write_text('{"version": 1, "counts": [[0, 1')          # a crash mid-write (old)
    engine = _hybrid(path, state)
    assert "routing" in caplog.text and not engine.model.experts.options.hot_set
    engine.generate(PROMPT, GREEDY)
    assert engine.save_learned_state()
    assert json.loads((state / "routing.json").read_text())["counts"]
    assert not list(state.glob("*.tmp"))                                         # written atomically


def test_the_service_writes_the_learned_state_when_the_model_is_unloaded(ftw_packages, tmp_path):
    from runtime.service import GenerateJob, LoadOptions, Service

    path = ftw_packages("qwen3_moe", "int4")
    loader = lambda p, options, progress: _hybrid(p, options.state_dir)       # noqa: E731
    service = Service(engine_loader=loader)
    try:
        service.load_sync(path, LoadOptions(device="cpu", state_dir=str(tmp_path / "state")))
        import threading

        finished = threading.Event()
        sink = lambda event: finished.set() if type(event).__name__ in ("Finished", "Failed") else None  # noqa: E731
        job = service.submit(GenerateJob(prompt_ids=PROMPT, prompt_text="", sampling=GREEDY, sink=sink,
                                         parse=False))
        assert finished.wait(60) and job.completion_tokens > 0
        assert not (tmp_path / "state" / "routing.json").exists()        # not yet: written at unload or idle
        done = []
        service.unload(on_done=lambda: done.append(True))
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done and json.loads((tmp_path / "state" / "routing.json").read_text())["counts"]
    finally:
        service.close()


def test_load_options_carry_the_state_folder_and_refuse_unknown_ones():
    from runtime.service import LoadOptions

    assert LoadOptions.from_dict({"state_dir": "/x/y"}).state_dir == "/x/y"
    with pytest.raises(ValueError, match="state_folder"):
        LoadOptions.from_dict({"state_folder": "/x/y"})


def test_each_package_gets_its_own_state_folder_inside_the_data_folder(tmp_path):
    from app.paths import model_state_dir, user_paths

    paths = user_paths()
    a = model_state_dir(paths, tmp_path / "models" / "Qwen3-30B-A3B-int4")
    b = model_state_dir(paths, tmp_path / "other" / "Qwen3-30B-A3B-int4")
    assert a != b and a.parent == b.parent == paths.data / "model-state"
    assert a.name.startswith("Qwen3-30B-A3B-int4-")
    assert a == model_state_dir(paths, str(tmp_path / "models" / "Qwen3-30B-A3B-int4"))   # stable
    odd = model_state_dir(paths, tmp_path / "..evil name;rm -rf")
    assert odd.parent == paths.data / "model-state" and "/" not in odd.name and " " not in odd.name
    assert Path(odd).resolve().is_relative_to((paths.data / "model-state").resolve())
