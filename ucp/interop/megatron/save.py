"""A Megatron-LM save on disk: its names (the tracker, iteration directories, rank directories and files), the
layouts its torch-format files are split by, and which iteration a path given by a user names.

`iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` is the torch format (one file per TP, PP and EP rank;
DP replicas are not saved); an iteration directory with `metadata.json` is the torch_dist format
(ucp.interop.megatron.dist). Names only: nothing here reads a tensor (and nothing imports torch).
"""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import LayoutError
from ...sharding.layout import Layout
from ..errors import InteropError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # the distributed optimizer's state, beside the rank file
CHECKPOINT_VERSION = 3.0
# What `ucp convert`'s --from and --to name besides a layout: a ucp checkpoint, and Megatron's dist_checkpointing
# format (which needs no layout)
UNIVERSAL = "universal"
TORCH_DIST = "torch_dist"
METADATA_JSON = "metadata.json"  # what makes an iteration directory one of the torch_dist format
# Megatron-Core linear layers carry an `_extra_state` entry (None with the local spec, FP8 metadata with TE);
# a strict load_state_dict needs it present.
EXTRA_STATE_OWNERS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    *(f"self_attention.linear_{x}" for x in ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj")),
    "linear_fc1",
    "linear_fc2",
    "output_layer",
)


def extra_state_owner(name: str) -> str | None:
    """The Megatron-Core linear layer that a tensor named `name` is the weight of, if it is one with an
    `_extra_state` entry (`EXTRA_STATE_OWNERS`)."""
    owner = name.removesuffix(".weight")
    return owner if name.endswith(".weight") and owner.endswith(EXTRA_STATE_OWNERS) else None


_MEGATRON_LAYOUT = re.compile(r"tp(\d+)(?:pp(\d+))?(?:vpp(\d+))?(?:ep(\d+))?")


def parse_megatron_layout(text: str) -> Layout:
    """tp{T}[pp{P}][vpp{V}][ep{E}]: what a Megatron torch checkpoint's files are split by (DP is not saved)."""
    m = _MEGATRON_LAYOUT.fullmatch(text.strip().lower())
    if m is None:
        raise LayoutError(
            f"malformed Megatron layout {text!r}: expected tp{{T}}[pp{{P}}][vpp{{V}}][ep{{E}}] (e.g. tp4pp8, tp2ep4)"
        )
    tp, pp, vpp, ep = (int(g) if g else 1 for g in m.groups())
    return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=ep)


def megatron_name(layout: Layout) -> str:
    return (
        f"tp{layout.tp}pp{layout.pp}"
        + (f"vpp{layout.vpp}" if layout.vpp > 1 else "")
        + (f"ep{layout.ep}" if layout.ep > 1 else "")
    )


def rank_dirname(layout: Layout, tp: int, pp: int, ep: int) -> str:
    """Megatron's get_checkpoint_name: _PPP only when pp > 1, _EEE only with expert parallelism."""
    name = f"mp_rank_{tp:02d}"
    if layout.pp > 1:
        name += f"_{pp:03d}"
    if layout.ep > 1:
        name += f"_{ep:03d}"
    return name


def rank_files(layout: Layout) -> dict[str, int]:
    """Rank directory name -> ucp rank (tp=t, dp=e, pp=p) for every file of a layout."""
    return {
        rank_dirname(layout, t, p, e): layout.rank(t, e, p)
        for p in range(layout.pp)
        for e in range(layout.ep)
        for t in range(layout.tp)
    }


def is_torch_dist(iter_dir: Path) -> bool:
    return (iter_dir / METADATA_JSON).is_file()


_ITERATION_DIR = re.compile(r"iter_(\d+)")


def iteration_dir(root: Path, iteration: int | None) -> tuple[int, Path]:
    """(the iteration, its directory) of a Megatron-LM save root (the tracker names the latest, `iteration` another),
    or of an iteration directory given itself (`iter_NNNNNNN`, `release`), as users point at one."""
    named = _ITERATION_DIR.fullmatch(root.name)
    if (named or root.name == "release") and root.is_dir() and not (root / TRACKER).is_file():
        it = int(named[1]) if named else 0
        if iteration is not None and iteration != it:
            raise InteropError(f"--iteration {iteration}, but {root} is the directory of iteration {it}")
        return it, root
    if iteration is None:
        tracker = root / TRACKER
        if not tracker.is_file():
            raise InteropError(
                f"{root} is not a Megatron checkpoint directory (no {TRACKER}, and not an iter_NNNNNNN directory)"
            )
        text = tracker.read_text().strip()
        if text == "release":
            return 0, root / "release"
        try:
            iteration = int(text)
        except ValueError:
            raise InteropError(f"{tracker} holds {text!r}, not an iteration number") from None
    return iteration, root / f"iter_{iteration:07d}"
