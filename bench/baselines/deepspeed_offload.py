#!/usr/bin/env python3
"""The peer baseline DeepSpeed ZeRO-Offload / ZeRO-Infinity: transformers' model of a config.json
under deepspeed.initialize, timed the way oom-train reports itself (bench/baselines/common.py: the
same data, loss, output, JSON and exit status as the FSDP2 baseline).

  python3 bench/baselines/deepspeed_offload.py --config examples/configs/moe-5b.json --seq 4096 \
      [--stage 2|3] [--batches RUN.tok] [--steps 4] [--json out.json]
  torchrun --nproc-per-node 2 bench/baselines/deepspeed_offload.py ...   (several GPUs)

--stage 2 (ZeRO-Offload, the default): bf16 parameters on the GPU; fp32 master weights, gradients
and AdamW moments on the host, pinned, updated by DeepSpeed's CPU Adam (AVX-512, built on first
use by its op builder with ninja and the host compiler). --stage 3 (ZeRO-Infinity, CPU tier): the
parameters too live on the host and are fetched layer by layer. bf16 compute; per-layer activation
checkpointing as transformers does it (unless --no-checkpointing); AdamW with the lr and weight
decay given. DeepSpeed is not on the GPU machine: `bash scripts/fetch-peer-wheels.sh` puts it and
its dependencies as files in .whl/ (git-ignored), and scripts/gpu-check.sh installs them there.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def ds_config(args, stage):
    """The DeepSpeed configuration of the run (a dict, as deepspeed.initialize takes it)."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def parse_args(argv=None):
    return common.parse_args(__doc__, argv, lambda ap: ap.add_argument(
        "--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage: 2 offloads the optimizer, 3 the parameters too"))


def main(argv=None):
    args = parse_args(argv)
    try:
        import deepspeed
    except ImportError:
        sys.exit("deepspeed baseline: no deepspeed module; `bash scripts/fetch-peer-wheels.sh` here, then "
                 "scripts/gpu-check.sh installs it on the GPU machine (PYTHONPATH=build-gpu/peer-python)")

    def prepare(model, world, device):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(args, args.stage))

        def update(loss):
            engine.backward(loss)
            engine.step()
        return (lambda ids: engine(input_ids=ids)), update

    return common.run(args, f"deepspeed-zero{args.stage}-offload", "deepspeed" if args.stage == 2 else "deepspeed-zero3",
                      prepare, {"deepspeed": deepspeed.__version__, "zero_stage": args.stage})


if __name__ == "__main__":
    sys.exit(main())
