"""Inspect a training checkpoint or export its model weights.

    python -m m6.checkpoint info runs/tiny                       # the latest checkpoint of a run
    python -m m6.checkpoint info runs/tiny/checkpoints/step_00000300 --json
    python -m m6.checkpoint export runs/tiny model.safetensors [--dtype fp32|bf16]
    python -m m6.checkpoint delink runs/pseudo runs/real         # pseudo-to-real: unshare the blocks

PATH: a step directory, its .metadata file, or a run directory / its checkpoints directory (then
the latest complete checkpoint there). Exit code 2 when PATH is not a readable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

from m6.checkpoint.delink import delink_checkpoint
from m6.checkpoint.export import EXPORT_DTYPES, export_safetensors
from m6.checkpoint.info import checkpoint_info, format_info
from m6.checkpoint.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m6.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="step, layout, model summary and size on disk (reads no tensors)")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    export = commands.add_parser("export", help="the model weights as one safetensors file, streamed tensor by tensor")
    export.add_argument("path")
    export.add_argument("out", help="output file, e.g. model.safetensors")
    export.add_argument("--dtype", choices=sorted(EXPORT_DTYPES),
                        help="cast floating-point weights (default: as saved)")
    delink = commands.add_parser("delink", help="a model.share_layers checkpoint as the real model's: every block "
                                 "its own copy of the shared weights and optimizer state")
    delink.add_argument("path")
    delink.add_argument("out", help="run directory to write the delinked checkpoint into (as the same step)")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            summary = checkpoint_info(args.path)
            print(json.dumps(summary, indent=2) if args.json else format_info(summary))
        elif args.command == "delink":
            done = delink_checkpoint(args.path, args.out)
            print(f"wrote {done['dst']}: step {done['step']} of {done['src']} with {done['copied_tensors']} block "
                  f"tensors copied out of model.share_layers={done['share_layers']}; resume it with "
                  f"model.share_layers=1 run.dir={args.out}")
        else:
            done = export_safetensors(args.path, args.out, args.dtype)
            print(f"wrote {done['out']}: {done['num_tensors']} tensors, {done['size_bytes']:,} bytes "
                  f"(model weights of {done['path']}, step {done['step']})")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
