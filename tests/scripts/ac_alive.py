"""One process of tests/test_activations.py::test_what_checkpointing_keeps_alive: which blocks' inputs are still
alive when forward has ended, read through weak references to their storage (so whatever holds one counts:
autograd's saved tensors, a checkpoint's saved inputs, any other reference), for each variant of checkpointing;
then backward and a step run as usual.

    python ac_alive.py --out DIR --variants JSON
"""

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from lightning_mics.app.models import GPT, GPTConfig  # noqa: E402
from lightning_mics.fabric import MiCSStrategy  # noqa: E402


def alive_after_forward(options: dict) -> dict:
    options = dict(options)
    precision = options.pop("precision", "32-true")  # the variant's Fabric precision, the rest MiCS options
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision, strategy=MiCSStrategy(**options))
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32))
    inputs = []
    for block in model.h:
        block.register_forward_pre_hook(lambda module, args: inputs.append(StorageWeakRef(args[0].untyped_storage())))
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))
    gc.collect()
    alive = [not ref.expired() for ref in inputs[:4]]
    fabric.backward(loss)
    opt.step()
    return {"alive": alive, "replays": len(inputs) - 4, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True)
    args = parser.parse_args()
    res = [alive_after_forward(v) for v in json.loads(args.variants)]
    Path(args.out, "result0.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
