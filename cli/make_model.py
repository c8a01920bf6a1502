"""``stage make-model``: write a random-weight checkpoint (``stages.modelgen``) for tests and benchmarks."""

from __future__ import annotations

import argparse

from stages.modelgen import FAMILIES, SIZES, TEXT_MODELS, VISION_TOWERS


def add_make_model_parser(commands: argparse._SubParsersAction) -> None:
    make = commands.add_parser("make-model", help="write a random-weight checkpoint for tests and benchmarks")
    make.add_argument("--family", choices=FAMILIES, required=True)
    make.add_argument("--size", choices=SIZES, default="tiny")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--vision", choices=VISION_TOWERS, default=None, help="LLaVA only")
    make.add_argument("--text", choices=TEXT_MODELS, default=None, help="LLaVA only")
    make.add_argument("--hub-layout", action="store_true",
                      help="write it as the family's Hugging Face repository ships it: bfloat16 shards with "
                           "model.safetensors.index.json, the chat template in its own file, the repository's "
                           "config.json and preprocessor_config.json fields")
    make.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from stages.modelgen import make_model

    print(make_model(args.family, args.size, args.out, seed=args.seed, vision=args.vision, text=args.text,
                     hub_layout=args.hub_layout))
    return 0
