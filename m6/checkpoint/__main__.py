"""Inspect a training checkpoint, export its model weights, import a Hugging Face model.

    python -m m6.checkpoint info runs/tiny                       # the latest checkpoint of a run
    python -m m6.checkpoint info runs/tiny/checkpoints/step_00000300 --json
    python -m m6.checkpoint export runs/tiny model.safetensors [--dtype fp32|bf16]
    python -m m6.checkpoint export runs/tiny hf_out --format hf  # a transformers model directory
    python -m m6.checkpoint import-hf HF_DIR OUT_DIR             # Mixtral, Qwen2/3-MoE, OLMoE -> m6
    python -m m6.checkpoint delink runs/pseudo runs/real         # pseudo-to-real: unshare the blocks

PATH: a step directory, its .metadata file, or a run directory / its checkpoints directory (then
the latest complete checkpoint there). Exit code 2 when PATH is not a readable checkpoint, or
HF_DIR not an importable model (the error names the file or field); nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import sys

from m6.checkpoint.delink import delink_checkpoint
from m6.checkpoint.export import EXPORT_DTYPES, export_safetensors
from m6.checkpoint.hf_export import export_hf
from m6.checkpoint.hf_import import import_hf
from m6.checkpoint.info import checkpoint_info, format_info
from m6.checkpoint.errors import CheckpointError
from m6.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m6.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="step, layout, model summary and size on disk (reads no tensors)")
    info.add_argument("path")
    info.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    export = commands.add_parser("export", help="the model weights as one safetensors file, or (--format hf) a "
                                 "Hugging Face model directory, streamed tensor by tensor")
    export.add_argument("path")
    export.add_argument("out", help="output file, e.g. model.safetensors (--format hf: a new directory)")
    export.add_argument("--dtype", choices=sorted(EXPORT_DTYPES),
                        help="cast floating-point weights (default: as saved)")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: m6's tensor names in one file; hf: config.json + safetensors that "
                             "transformers loads as the matching architecture (text part)")
    importer = commands.add_parser("import-hf", help="a Hugging Face MoE model directory (Mixtral, Qwen2-MoE, "
                                    "Qwen3-MoE, OLMoE) as an m6 config and checkpoint")
    importer.add_argument("hf_dir", help="config.json + *.safetensors")
    importer.add_argument("out_dir", help="a new directory: config.yaml + checkpoints/step_00000000")
    importer.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="fp32",
                           help="dtype of the imported weights (default fp32, m6's master weights)")
    importer.add_argument("--seed", type=int, default=0, help="seed of the m6 tensors HF has no counterpart for")
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
        elif args.command == "import-hf":
            done = import_hf(args.hf_dir, args.out_dir, args.dtype, args.seed)
            fresh = f"; initialised here (no HF counterpart): {', '.join(done['fresh'])}" if done["fresh"] else ""
            print(f"wrote {done['out']}: {done['family']} as {done['num_tensors']} m6 tensors in {done['checkpoint']}"
                  f"{fresh}; train from it with --config {done['out']}/config.yaml (checkpoint.init_from is set)")
        elif args.format == "hf":
            done = export_hf(args.path, args.out, args.dtype)
            dropped = f"; left out (no place in a text-only model): {', '.join(done['dropped'])}" if done["dropped"] else ""
            print(f"wrote {done['out']}: {done['architecture']}, {done['num_tensors']} tensors, {done['size_bytes']:,} "
                  f"bytes in {len(done['files'])} file(s) (step {done['step']} of {done['path']}){dropped}")
        else:
            done = export_safetensors(args.path, args.out, args.dtype)
            print(f"wrote {done['out']}: {done['num_tensors']} tensors, {done['size_bytes']:,} bytes "
                  f"(model weights of {done['path']}, step {done['step']})")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
