"""fastremover/cache.py: the persistent cache of warm-up results (keys, invalidation, corrupt entries, concurrent
writers, folders that cannot be written) and its users on the CPU: cudnn_conv's plan choice and the Triton kernels'
autotune results (with stand-ins for cuDNN and the timing)."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fastremover import cache as cache_mod
from fastremover.cache import PersistentCache, environment
from fastremover.env import cache_dir
from helpers import REPO

ENV = {"gpu": "NVIDIA H200", "driver": "13.0", "torch": "2.13.0", "triton": "3.9.0", "cudnn": 91900}


class Notes(list):
    def __call__(self, message):
        self.append(message)


def test_the_cache_folder_comes_from_the_environment(tmp_path):
    assert cache_dir({"FASTREMOVER_CACHE_DIR": str(tmp_path)}) == str(tmp_path)
    assert cache_dir({"FASTREMOVER_CACHE_DIR": "off"}) is None and cache_dir({"FASTREMOVER_CACHE_DIR": "none"}) is None
    default = cache_dir({"XDG_CACHE_HOME": "/xdg"})
    if sys.platform.startswith("linux"):
        assert default == "/xdg/fastremover"
        assert cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache", "fastremover")


def test_hit_and_every_part_of_the_key_invalidates(tmp_path):
    c = PersistentCache(tmp_path, note=Notes())
    key = ("conv", [1, 96, 4, 480, 832], torch.float16)
    assert c.get("ns", key, ENV) is None
    assert c.put("ns", key, {"plan": "eng62"}, ENV)
    assert c.get("ns", key, ENV) == {"plan": "eng62"}
    assert PersistentCache(tmp_path).get("ns", key, dict(ENV)) == {"plan": "eng62"}  # another process's view
    for part, value in [("gpu", "NVIDIA H100"), ("driver", "13.1"), ("torch", "2.14.0"), ("triton", "3.10.0"),
                        ("cudnn", 92000)]:
        assert c.get("ns", key, {**ENV, part: value}) is None, part  # any version change is a miss
    assert c.get("ns", ("conv", [1, 96, 4, 480, 848], torch.float16), ENV) is None  # another signature
    assert c.get("other", key, ENV) is None  # another namespace
    assert c.path("ns", key, ENV) != c.path("ns", key, {**ENV, "gpu": "x"})
    assert c.stats()["hits"] == 1 and c.stats()["writes"] == 1 and c.stats()["misses"] == 8
    assert c.stats()["namespaces"] == {"ns": {"hits": 1, "misses": 7, "writes": 1},
                                       "other": {"hits": 0, "misses": 1, "writes": 0}}


def test_environment_names_the_device_and_the_libraries():
    env = environment("cpu")
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert {"fastremover", "cuda", "cudnn", "cudnn_frontend", "triton"} <= set(env)
    json.dumps(env)  # plain JSON


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"format": 1, "namespace": "ns", "env": {}, "key": 1,
                                                              "value": 2}), "", "[1, 2]"])
def test_a_corrupt_entry_is_ignored_with_a_note_and_rewritten(tmp_path, garbage):
    notes = Notes()
    c = PersistentCache(tmp_path, note=notes)
    c.put("ns", "k", {"v": 1}, ENV)
    path = c.path("ns", "k", ENV)
    path.write_text(garbage)
    assert c.get("ns", "k", ENV) is None
    assert len(notes) == 1 and "corrupt" in notes[0] and str(path) in notes[0]
    assert c.get("ns", "k", ENV) is None and len(notes) == 1  # one note per entry
    assert c.put("ns", "k", {"v": 3}, ENV)
    assert c.get("ns", "k", ENV) == {"v": 3} and json.loads(path.read_text())["value"] == {"v": 3}


def test_a_folder_that_cannot_be_written_turns_the_cache_off_with_one_note(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    notes = Notes()
    c = PersistentCache(blocker / "cache", note=notes)  # a file in the way: mkdir fails (as root too)
    assert c.get("ns", "k", ENV) is None
    assert c.put("ns", "k", 1, ENV) is False and not c.enabled
    assert c.put("ns", "k2", 2, ENV) is False and c.usable_dir("triton") is None
    assert len(notes) == 1 and "running without a persistent cache" in notes[0]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permission bits do not bind root")
def test_a_read_only_cache_folder(tmp_path):
    root = tmp_path / "ro"
    c = PersistentCache(root)
    c.put("ns", "k", {"v": 1}, ENV)  # an entry from before the folder became read-only
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        folder.chmod(0o555)
    try:
        notes = Notes()
        ro = PersistentCache(root, note=notes)
        assert ro.get("ns", "k", ENV) == {"v": 1}  # still read
        assert ro.put("ns", "k2", {"v": 2}, ENV) is False and not ro.enabled
        assert len(notes) == 1 and "cannot be written" in notes[0]
        assert ro.get("ns", "k", ENV) is None  # off for the rest of the process
    finally:
        for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            folder.chmod(0o755)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EDQUOT])
def test_a_full_or_read_only_disk_degrades_without_an_error(tmp_path, monkeypatch, code):
    notes = Notes()
    c = PersistentCache(tmp_path, note=notes)

    def replace(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cache_mod.os, "replace", replace)
    assert c.put("ns", "k", 1, ENV) is False and not c.enabled and len(notes) == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the temporary file is gone too


def test_two_processes_writing_the_same_entries_at_once(tmp_path):
    """Two writer processes race on the same 5 entries (and each reads them back) while this process reads them:
    every read is a miss or a whole value, never an error or a torn entry; afterwards each entry holds one writer's
    value and no temporary file is left."""
    script = textwrap.dedent(f"""
        import sys
        from fastremover.cache import PersistentCache
        env = {ENV!r}
        c = PersistentCache(sys.argv[1], note=lambda m: sys.exit("note: " + m))
        me = int(sys.argv[2])
        for i in range(150):
            key = ("k", i % 5)
            assert c.put("ns", key, {{"writer": me, "i": i, "pad": "x" * 2000}}, env)
            got = c.get("ns", key, env)
            assert got is not None and got["pad"] == "x" * 2000, got
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                      os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(w)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    reader = PersistentCache(tmp_path, note=lambda m: pytest.fail(m))
    while any(p.poll() is None for p in procs):
        for i in range(5):
            got = reader.get("ns", ("k", i), ENV)
            assert got is None or (got["writer"] in (1, 2) and got["pad"] == "x" * 2000)
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0 and out.strip() == "ok", err
    assert sorted(reader.get("ns", ("k", i), ENV)["writer"] in (1, 2) for i in range(5)) == [True] * 5
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".json")]
    assert leftovers == []


def test_tool_dirs_go_into_the_cache_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "mine"))
    c = PersistentCache(tmp_path / "c")
    done = cache_mod.install_tool_dirs(c)
    assert done["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton") == os.environ["TRITON_CACHE_DIR"]
    assert done["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "mine")  # the user's own setting stays
    assert (tmp_path / "c" / "triton").is_dir() and not list((tmp_path / "c" / "triton").iterdir())
    monkeypatch.delenv("TRITON_CACHE_DIR")
    blocked = tmp_path / "file"
    blocked.write_text("")
    notes = Notes()
    assert cache_mod.install_tool_dirs(PersistentCache(blocked, note=notes)).get("TRITON_CACHE_DIR") is None
    assert "TRITON_CACHE_DIR" not in os.environ and len(notes) == 1  # Triton keeps its own default folder


# ----------------------------------------------------------------------------------------------------------------------
# Users: cudnn_conv's plan choice and the Triton autotune results


class _FakePlans:
    """cuDNN stand-in: plan 'good' computes torch's conv, 'off' adds one to an element."""

    builds: list = []

    def __init__(self, x, weight, y, stride, padding, names):
        type(self).builds.append(tuple(names))
        self.built = {n: i for i, n in enumerate(names) if n in ("good", "off")}
        self.failed = {n: "not offered" for n in names if n not in self.built}

    def run(self, index, x, weight, y):
        y.copy_(F.conv3d(x, weight, None, 1, (0, 1, 1)))
        if index == self.built.get("off"):
            y.view(-1)[0] += 1


def _clock():
    def time_ms(fn):
        time_ms.calls += 1
        return 5.0 if time_ms.calls % 2 else 1.0  # torch's call, then the candidate: the candidate wins
    time_ms.calls = 0
    return time_ms


def test_conv_plan_choice_is_persisted_and_reused_after_one_equality_check(tmp_path):
    from fastremover.fast.cudnn_conv import ConvPlans

    store = PersistentCache(tmp_path)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4, 4, 6, 7, generator=g), torch.randn(4, 4, 3, 3, 3, generator=g)
    want = F.conv3d(x, w, None, 1, (0, 1, 1))
    _FakePlans.builds = []
    first = ConvPlans(torch.device("cpu"), candidates=("off", "good"), min_gflop=0.0, builder=_FakePlans,
                      time_ms=_clock(), cache=store)
    assert torch.equal(first.conv(x, w, 1, (0, 1, 1)), want)
    (choice,) = first.choices.values()
    assert choice.name == "good" and not choice.cached and _FakePlans.builds == [("off", "good")]
    assert store.writes == 2  # the signature's choice and its class's (cudnn_conv.ConvPlans.class_key)
    # a new process: the stored choice is built alone, checked once against torch's output, and used; no timing
    clock = _clock()
    second = ConvPlans(torch.device("cpu"), candidates=("off", "good"), min_gflop=0.0, builder=_FakePlans,
                       time_ms=clock, cache=PersistentCache(tmp_path))
    assert torch.equal(second.conv(x, w, 1, (0, 1, 1)), want)
    (choice,) = second.choices.values()
    assert choice.name == "good" and choice.cached and _FakePlans.builds[-1] == ("good",) and clock.calls == 0
    x2 = torch.randn(1, 4, 4, 6, 7, generator=g)
    assert torch.equal(second.conv(x2, w, 1, (0, 1, 1)), F.conv3d(x2, w, None, 1, (0, 1, 1)))
    # another candidate list is another key: chosen again
    third = ConvPlans(torch.device("cpu"), candidates=("good",), min_gflop=0.0, builder=_FakePlans, time_ms=_clock(),
                      cache=PersistentCache(tmp_path))
    third.conv(x, w, 1, (0, 1, 1))
    assert not next(iter(third.choices.values())).cached


def test_a_conv_class_choice_carries_to_a_new_size_in_a_new_process(tmp_path):
    """A new process meeting a conv of a known class at a new input size builds the class's plan alone, checks it
    against torch's output and a random input's, and uses it without timing; the signature's choice is stored."""
    from fastremover.fast.cudnn_conv import ConvPlans

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 4, 4, 6, 7, generator=g), torch.randn(4, 4, 3, 3, 3, generator=g)
    first = ConvPlans(torch.device("cpu"), candidates=("off", "good"), min_gflop=0.0, builder=_FakePlans,
                      time_ms=_clock(), cache=PersistentCache(tmp_path))
    first.conv(x, w, 1, (0, 1, 1))
    _FakePlans.builds = []
    clock = _clock()
    store = PersistentCache(tmp_path)
    second = ConvPlans(torch.device("cpu"), candidates=("off", "good"), min_gflop=0.0, builder=_FakePlans,
                       time_ms=clock, cache=store)
    x2 = torch.randn(1, 4, 4, 9, 5, generator=g)  # the same conv at another crop size
    assert torch.equal(second.conv(x2, w, 1, (0, 1, 1)), F.conv3d(x2, w, None, 1, (0, 1, 1)))
    (choice,) = second.choices.values()
    assert choice.name == "good" and choice.inferred and _FakePlans.builds == [("good",)] and clock.calls == 0
    key = second.cache_key(x2, w, (1, 1, 1), (0, 1, 1))
    assert store.get("cudnn_conv_plan", key, environment("cpu"))["plan"] == "good"


def test_a_stored_plan_that_no_longer_gives_torchs_bits_is_dropped_and_chosen_again(tmp_path):
    from fastremover.fast.cudnn_conv import ConvPlans

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 4, 4, 6, 7, generator=g), torch.randn(4, 4, 3, 3, 3, generator=g)
    notes = Notes()
    store = PersistentCache(tmp_path, note=notes)
    plans = ConvPlans(torch.device("cpu"), candidates=("off", "good"), min_gflop=0.0, builder=_FakePlans,
                      time_ms=_clock(), cache=store)
    key = plans.cache_key(x, w, (1, 1, 1), (0, 1, 1))
    store.put("cudnn_conv_plan", key, {"plan": "off"}, environment("cpu"))  # a stored choice that is now wrong
    _FakePlans.builds = []
    y = plans.conv(x, w, 1, (0, 1, 1))
    assert torch.equal(y, F.conv3d(x, w, None, 1, (0, 1, 1)))
    (choice,) = plans.choices.values()
    assert choice.name == "good" and not choice.cached and _FakePlans.builds == [("off",), ("off", "good")]
    assert store.get("cudnn_conv_plan", key, environment("cpu")) == {"plan": "good", "torch_ms": 5.0, "ms": 1.0}
    assert any("no longer" in n for n in notes)


def test_autotune_results_are_persisted_and_checked_against_the_candidates(tmp_path):
    from dataclasses import dataclass

    from fastremover.fast.kernels._common import autotune

    @dataclass(frozen=True)
    class Cfg:
        block: int
        warps: int

    cands = [Cfg(64, 4), Cfg(128, 8)]
    store = PersistentCache(tmp_path)
    key = (96, 96, 1024, torch.float8_e4m3fn, 0, False, 0)
    store.put("autotune", ["conv3d_fp8", key], {"type": "Cfg", "config": {"block": 128, "warps": 8}},
              environment("cpu"))
    launched = []
    got = autotune({}, key, cands, launched.append, True, "conv3d_fp8", device=torch.device("cpu"), persistent=store)
    assert got == Cfg(128, 8) and launched == []  # from the cache: nothing compiled or timed
    # a stored config that is no longer a candidate is a miss (here: tuning off, so the first candidate)
    store.put("autotune", ["conv3d_fp8", key], {"type": "Cfg", "config": {"block": 256, "warps": 8}},
              environment("cpu"))
    assert autotune({}, key, cands, launched.append, False, "conv3d_fp8", device=torch.device("cpu"),
                    persistent=store) == Cfg(64, 4)


def test_a_tuned_config_is_stored_for_the_next_process(tmp_path, monkeypatch):
    import triton.testing
    from dataclasses import dataclass

    from fastremover.fast.kernels._common import autotune

    @dataclass(frozen=True)
    class Cfg:
        block: int

    times = {Cfg(64): 2.0, Cfg(128): 1.0, Cfg(256): 3.0}
    current = []

    def do_bench(fn, **kw):
        fn()
        return times[current[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    store = PersistentCache(tmp_path)
    key = ("k", 1)
    assert autotune({}, key, list(times), current.append, True, "kern", device="cpu", persistent=store) == Cfg(128)
    assert len(current) == 6  # each candidate compiled once and timed once
    current.clear()
    again = PersistentCache(tmp_path)  # the next process
    assert autotune({}, key, list(times), current.append, True, "kern", device="cpu", persistent=again) == Cfg(128)
    assert current == [] and again.hits == 1
