"""meshtron's Python API in your own training loop: torchrun --nproc-per-node 2 examples/train_loop.py"""
import os

import torch
import torch.distributed as dist

import meshtron
from meshtron.data.corpus import stdlib_documents
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.model import Transformer, preset

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
world = dist.get_world_size()
plan = {"dp": world, "zero": 3 if world > 1 else 0}  # or a meshtron.Plan, or a saved plan's path
mesh = meshtron.build_mesh(plan)
torch.manual_seed(0)                                  # same weights on every rank
with torch.device("meta"):                            # no rank holds the whole model
    model = Transformer(preset("tiny"))
pm = meshtron.parallelize(model, plan, mesh)          # materializes this rank's shards only
opt = meshtron.build_optimizer(pm, lr=3e-3, weight_decay=0.1)  # AdamW over this rank's parts

batch, seq, steps = 8, 64, 10                         # global batch: 8 sequences of 64 tokens
ids = ByteTokenizer().encode("\n".join(stdlib_documents(max_bytes=200_000)))
tokens = torch.tensor(ids[: steps * batch * (seq + 1)]).view(steps, batch, seq + 1)
rows, rank = batch // world, dist.get_rank()          # this data-parallel rank's rows
for step in range(steps):
    chunk = tokens[step, rank * rows:(rank + 1) * rows]
    inputs, targets = chunk[:, :-1], chunk[:, 1:]
    loss = pm.forward_backward(inputs, targets)       # global-mean loss, a 0-d tensor
    pm.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    if rank == 0 and step in (0, steps - 1):
        print(f"step {step + 1}: loss {float(loss):.4f}")  # a host sync: only when printing
dist.barrier()
meshtron.parallel.release_mesh(mesh)                  # destroy the mesh's process groups
dist.destroy_process_group()
