#!/usr/bin/env python3
"""The peer baseline PyTorch FSDP2: transformers' model of a config.json, timed the way oom-train
reports itself, so that OOM's figures read as ratios to a peer run on the same machine in the same
session (MISSION.md's peer table was measured this way: FSDP2, bf16 compute over fp32 parameters,
per-layer activation checkpointing, torch.optim.AdamW).

  python3 bench/baselines/fsdp2.py --config examples/configs/moe-5b.json --seq 4096 --batch 2 \
      [--offload] [--no-checkpointing] [--optimizer fused|foreach] [--batches RUN.tok]
      [--init-from RUN/checkpoint-000000] [--steps 4] [--json out.json]
  torchrun --nproc-per-node 2 bench/baselines/fsdp2.py ...     (several GPUs: batch per GPU)

Modes: plain FSDP2 (all state on the GPU) or --offload (CPUOffloadPolicy(pin_memory=True): fp32
parameters, gradients and AdamW state on the host, the optimizer step on the CPU). The model is
built and initialised on the GPU (transformers' init), then sharded, one FSDP unit per decoder
layer and one for the rest; MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). Each step
is one forward and backward of (batch, seq) tokens with oom-train's loss (mean cross-entropy of
each window's tokens 1..seq given 0..seq-1, on fp32 logits, plus the router's load-balancing loss
where the config asks for it) and one torch.optim.AdamW step (fused by default; --optimizer
foreach as MISSION.md's figures were taken); --init-from starts from oom-train's initial weights;
the windows are random tokens, or with --batches those of an oom-train run (its
--dump-batches file), so both train on the same data. Output, JSON and exit status:
bench/baselines/common.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def parse_args(argv=None):
    def extra(ap):
        ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: state and the optimizer on the host")
        ap.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                        help="torch.optim.AdamW's implementation: fused (default: one kernel, on the GPU or, "
                        "offloaded, the CPU) or foreach (MISSION.md's peer figures)")
    return common.parse_args(__doc__, argv, extra)


def main(argv=None):
    args = parse_args(argv)

    def prepare(model, world, device):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mesh = init_device_mesh(device, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True) if args.offload else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        impl = {"fused": True} if args.optimizer == "fused" else {"foreach": True}
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, **impl)

        def update(loss):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (lambda ids: model(input_ids=ids)), update

    return common.run(args, "fsdp2-offload" if args.offload else "fsdp2", "offload" if args.offload else "plain", prepare,
                      {"optimizer": f"torch.optim.AdamW ({args.optimizer})"})


if __name__ == "__main__":
    sys.exit(main())
