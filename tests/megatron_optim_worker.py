"""Megatron-Core's optimizer as the oracle of ucp's Megatron optimizer conversion for every family kind
(tests/test_megatron_order.py): megatron-core's model of KIND (megatron_order_worker.build) takes one step of its own
Adam, is saved as a Megatron-LM tp1 rank file, converted by ucp to tp2 and back, and loaded into a fresh model and
optimizer; OUT gets both optimizers' states by parameter name.

    python tests/megatron_optim_worker.py KIND CONFIG.json DIR OUT   as rank 0 of a world of one
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.megatron_order_worker import build
from tests.megatron_worker import Trainable, exit_now, load, perturb, save, setup, tokens


def main(kind: str, config_json: str, root: str, out: str) -> None:
    setup(0, 1)
    from ucp.interop.megatron.args import args_for
    from ucp.interop.megatron.convert import convert
    from ucp.sharding.families import FAMILIES
    from ucp.sharding.layout import parse_layout

    with open(config_json) as f:
        doc = json.load(f)
    config = FAMILIES[doc.pop("family")].config_cls.from_json(doc)
    model = build(kind)
    perturb(model)
    trained = Trainable(model, bf16=False)
    trained.step(tokens(seed=1))
    save(os.path.join(root, "src"), "mp_rank_00", trained, args_for(config, parse_layout("tp1pp1")))
    convert(os.path.join(root, "src"), os.path.join(root, "tp2"), from_layout="tp1", to_layout="tp2")
    convert(os.path.join(root, "tp2"), os.path.join(root, "back"), from_layout="tp2", to_layout="tp1")
    fresh = Trainable(build(kind), bf16=False)
    load(os.path.join(root, "back"), "mp_rank_00", fresh)
    torch.save({"saved": trained.state_by_name(), "loaded": fresh.state_by_name()}, out)
    print("ok", flush=True)
    exit_now()  # (megatron_worker.exit_now: no teardown, no process left behind)


if __name__ == "__main__":
    main(*sys.argv[1:5])
