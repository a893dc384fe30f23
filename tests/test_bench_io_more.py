"""bench_io extensions: the S3 target (embedded moto server), async saves and DCP side by side, the plain-copy
floor, --procs, writer threads against the writer process, and the reshard benchmark's read amplification."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bench_io import methods, state, targets

REPO = Path(__file__).resolve().parents[1]
NEW = ("ucp-async", "dcp", "dcp-async")


def _run(args: list[str], timeout: int = 150) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench_io", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_quick_run_with_s3_and_the_new_methods(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    methods_ = ",".join(("raw", "ucp", *NEW, "copy"))
    # 1 MiB: few tensors, since every request to the embedded server costs milliseconds
    args = ["--quick", "--size", "1MiB", "--targets", "tmpfs,s3", "--methods", methods_, "--small-tensors", "0"]
    args += ["--json", str(out)]
    proc = _run([*args, "--png", str(tmp_path / "r.png")])
    assert "blk/copy" in proc.stdout
    doc = json.loads(out.read_text())
    medians = {(m["method"], m["target"]): m for m in doc["medians"]}
    for target in ("tmpfs", "s3"):
        for name in ("raw", "ucp", *NEW):
            m = medians[(name, target)]
            assert m["save_gbps"] > 0 and m["load_gbps"] > 0 and not m["errors"], m
        for name in ("ucp-async", "dcp-async"):
            assert medians[(name, target)]["blocking_s"] > 0
        assert medians[("ucp-async", target)]["blocking_vs_copy"] > 0
        assert medians[("ucp-async", target)]["blocking_vs_dcp_async"] > 0
    assert medians[("ucp", "s3")]["cache"] == "s3"
    assert medians[("copy", "memory")]["blocking_s"] > 0
    assert doc["config"]["targets"]["s3"]["fstype"].startswith(("s3 (moto", "s3 (radosgw"))
    assert all(r["error"] is None for r in doc["results"])


def test_procs_2(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    _run(["--quick", "--procs", "2", "--targets", "tmpfs", "--methods", "raw,ucp-async", "--json", str(out)])
    doc = json.loads(out.read_text())
    for m in doc["medians"]:
        assert m["procs"] == 2 and m["save_gbps"] > 0 and m["load_gbps"] > 0, m
        assert 0 < m["rank_min_save_gbps"] and 0 < m["rank_min_load_gbps"]
    assert doc["medians"][0]["nbytes"] > 3 << 20  # both ranks' shares (2 x 2 MiB)


@pytest.mark.slow
def test_gil_compares_the_writer_threads_and_the_writer_process(tmp_path: Path) -> None:
    out = tmp_path / "gil.json"
    proc = _run(
        ["gil", "--size", "4MiB", "--repeats", "1", "--alone-s", "0.2", "--dir", str(tmp_path), "--json", str(out)]
    )
    assert "less slowdown of the loop: writer" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    for writer in ("threads", "process"):
        assert summary[writer]["save_s"] > 0 and summary[writer]["slowdown"] > 0 and summary[writer]["steps_per_s"] > 0


def test_reshard_tiny_amplification(tmp_path: Path) -> None:
    out = tmp_path / "rs.json"
    args = ["reshard", "--size", "2MiB", "--target", "tmpfs", "--inner-bytes", "2KiB", "--object-bytes", "16KiB"]
    args += ["--pack-below", "1KiB"]  # (packed atoms are read whole: only the norms, here)
    proc = _run([*args, "--json", str(out)])
    assert "amplif." in proc.stdout
    doc = json.loads(out.read_text())
    layouts = {r["layout"] for r in doc["ranks"]}
    assert len(layouts) == 3
    for r in doc["ranks"]:
        assert r["verified"] is True, r
        assert 1.0 <= r["amplification"] <= 1.25, r
        assert r["load_gbps"] > 0 and r["raw_gbps"] > 0


def test_s3_target_round_trips_the_single_object_methods() -> None:
    t = targets.s3_target(None)
    try:
        s = state.make_state("t", state.transformer_specs(64 << 10) + state.small_specs(3), seed=5)
        for name, cls in methods.METHODS.items():
            if not cls.remote or not cls.storage or name in ("raw", "ucp", *NEW):  # those: the quick run
                continue
            if not cls.installed():  # (a peer installed apart, as `pip install` in its docstring says)
                continue
            d = t.workdir(name)
            m = cls(io_threads=4)
            m.save(s, d)
            assert s.verify(m.load(d)) is None, name
            t.remove(d)
            assert not d.fs.find(d.path), name
    finally:
        t.close()
    assert t.server is not None  # the embedded server is stopped: its port refuses connections
    with pytest.raises(OSError):
        url = urlsplit(t.server.endpoint.url)
        socket.create_connection((url.hostname, url.port), timeout=5).close()


@pytest.mark.parametrize("size", [8 << 20, 256 << 20])
def test_reshard_config_fits_and_divides(size: int) -> None:
    from bench_io.reshard import size_config
    from ucp.sharding.reshard import DEFAULT_STATES

    config, nbytes = size_config(size, DEFAULT_STATES)
    assert nbytes <= size
    assert config.num_key_value_heads % 4 == 0 and config.num_hidden_layers % 2 == 0
    assert config.num_local_experts % 2 == 0


def test_coldstart_floor_reads_every_chunk_object_of_the_model_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    """The cold start's raw-read floor of ucp reads the files a load of the model's atoms reads: each object that
    holds one (its chunks; the packs that hold packed ones) once (no zarr.json, no object of optimizer state alone),
    every byte of it."""
    import random

    import torch

    import ucp
    from bench_io.coldstart import chunk_objects, raw_read
    from ucp.storage import LocalStorage

    rng = random.Random()
    url = tmp_path / "ckpt"
    model = {f"w{i}": torch.randn(rng.randint(1, 300), rng.randint(1, 40)) for i in range(rng.randint(2, 9))}
    model["big"] = torch.randn(600, 600)  # (not packed: 1.4 MB)
    optimizer = {"m": torch.randn(50), "big": torch.randn(300, 1000)}  # (the small one packed with the model's)
    ucp.save({"model": model, "optimizer": optimizer}, str(url), step=0)
    files = chunk_objects(url)
    reader = ucp.open_checkpoint(str(url))
    read: set[str] = set()
    real = LocalStorage.read_into
    monkeypatch.setattr(LocalStorage, "read_into", lambda self, key, *a: read.add(key) or real(self, key, *a))
    reader.read_atoms([p for p in reader.atoms if p.startswith("model/")])
    assert sorted(str(f.relative_to(url)) for f in files) == sorted(read)
    for threads in (1, rng.randint(2, 8)):
        assert raw_read(files, threads)() == sum(f.stat().st_size for f in files)


def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """`bench_io gpu --device cpu`, the benchmark's own smoke test (scripts/gpu_check.sh runs it on a GPU): every
    method runs, every load is the state, the medians and the floors are in the JSON."""
    out = tmp_path / "gpu.json"
    args = ["gpu", "--device", "cpu", "--size", "8MiB", "--tensors", "2", "--repeats", "1", "--dirs", str(tmp_path)]
    proc = _run([*args, "--trainer-steps", "0", "--json", str(out)])
    assert "| load | ucp |" in proc.stdout
    doc = json.loads(out.read_text())
    assert all(r["ok"] for r in doc["rows"]), [r for r in doc["rows"] if not r["ok"]]
    medians = {(m["phase"], m["method"]) for m in doc["medians"]}
    assert {("save", "floor"), ("save", "ucp-async-first"), ("load", "floor"), ("load", "ucp")} <= medians
    assert {("save", "dcp-async"), ("load", "safetensors"), ("load", "torch"), ("load", "pinned-raw")} <= medians


def test_a_gpu_benchmark_method_whose_setup_fails_is_recorded_and_the_others_run(tmp_path: Path, monkeypatch) -> None:
    """A method that fails outside its timed part (here the async manager's `prepare`, as page-locking can on a GPU
    machine) is a failed row of that method: the benchmark measures the others, writes its JSON and exits 1."""
    import ucp
    from bench_io import gpu

    def no_page_locked_memory(self, *args, **kwargs):
        raise ucp.UcpError("cannot page-lock 67108864 bytes of staging memory for the GPU (cudaHostRegister)")

    monkeypatch.setattr(ucp.CheckpointManager, "prepare", no_page_locked_memory)
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--size", "2MiB", "--tensors", "2", "--repeats", "1", "--dirs", str(tmp_path)]
    args += ["--saves", "floor,ucp-async,ucp-sync", "--loads", "floor,ucp", "--trainer-steps", "0", "--json", str(out)]
    assert gpu.main(args) == 1
    rows = json.loads(out.read_text())["rows"]
    failed = [(r["phase"], r["method"]) for r in rows if not r["ok"]]
    assert failed == [("save", "ucp-async")] and "cudaHostRegister" in rows[1]["error"]
    assert {(r["phase"], r["method"]) for r in rows if r["ok"]} == {
        ("save", "floor"),
        ("save", "ucp-sync"),
        ("load", "floor"),
        ("load", "ucp"),
    }


def test_readside_measures_every_scenario_and_its_ratios(tmp_path: Path) -> None:
    """`python -m bench_io readside` at tiny sizes: every scenario runs, every load is checked against what was saved,
    and the ratios come out (ucp's `into=` beside DCP's)."""
    from bench_io import readside

    out = tmp_path / "readside.json"
    argv = ["--repeats", "1", "--small", "40", "--disk", "40", "--mixed", "3MiB", "--dir", str(tmp_path)]
    assert readside.main([*argv, "--cache", "fadvise", "--json", str(out)]) == 0
    ratios = json.loads(out.read_text())["ratios"]
    for name in ("small: load against raw (no CRC)", "disk: cold load against raw-crc, 16 threads",
                 "mixed: load (into=) against DCP (fresh)"):  # fmt: skip
        assert ratios[name][0] > 0, name


def test_coldstart_loads_with_other_counts_of_reads_in_flight_fill_the_same_parameters(tmp_path: Path) -> None:
    """`bench_io coldstart --reads-in-flight`: ucp's "into" load with a count of reads in flight of the user's fills
    the job's parameters with the model's weights, as the default count does, and reads the same bytes."""
    import random

    import torch

    from bench_io.coldstart import ucp_load, ucp_params, write_sources
    from ucp.interop.weights import load_weights
    from ucp.sharding.families import MixtralConfig

    rng = random.Random()
    cfg = MixtralConfig(
        vocab_size=rng.choice((64, 96)),
        hidden_size=32,
        intermediate_size=rng.choice((16, 48)),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=rng.choice((2, 4)),
    )
    url = str(tmp_path / "ucp")
    write_sources(cfg, tmp_path, url, None)
    expected = load_weights(url, "tp1", 0).params
    read = ucp_load(url, "tp1", None, params := ucp_params(url, "tp1", None))()
    for reads in (1, rng.randint(2, 5)):
        job = ucp_params(url, "tp1", None)
        assert ucp_load(url, "tp1", None, job, reads)() == read
        assert job.keys() == expected.keys() == params.keys()
        assert all(torch.equal(job[n], expected[n]) and torch.equal(params[n], expected[n]) for n in expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "0"], "argument --size: must be more than 0 bytes"),
        (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        (["--io-threads", "-3"], "argument --io-threads: must be at least 1"),
        (["--procs", "two"], "argument --procs: not a whole number: 'two'"),
        (["--json", "{missing}/figures.json"], "argument --json: {missing}/figures.json: no such directory"),
        (["--png", "{tmp}"], "is a directory"),
        (["coldstart", "--repeats", "0"], "argument --repeats: must be at least 1"),
        (["coldstart", "--size-gib", "nan"], "argument --size-gib: must be a number above 0"),
        (["coldstart", "--reads-in-flight", "16,"], None),  # (a trailing comma is only an empty item: accepted)
        (["coldstart", "--reads-in-flight", "16,0"], "argument --reads-in-flight: must be at least 1"),
        (["readside", "--small", "0"], "argument --small: must be at least 1"),
        (["reshard", "--size", "0"], "argument --size: must be more than 0 bytes"),
        (["reshard", "--json", "{missing}/x.json"], "no such directory"),
        (["gil", "--alone-s", "-1"], "argument --alone-s: must be a number above 0"),
        (["gpu", "--trainer-every", "0"], "argument --trainer-every: must be at least 1"),
        (["collectives", "--json", "{missing}/x.json"], "no such directory"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_before_the_run(argv, message, tmp_path: Path, capsys) -> None:
    """A count, size or output file the run cannot use is argparse's one-line error (exit 2), before any state is
    generated, not a traceback minutes in (or after the run, for an output file's directory)."""
    from bench_io.__main__ import main

    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    if message is None:  # (parsed: the run would start; only the parse is checked)
        from bench_io.args import counts

        assert counts(1)(argv[-1]) == [16]
        return
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message.format(missing=tmp_path / "missing") in err[-1], err
    assert not (tmp_path / "missing").exists()
