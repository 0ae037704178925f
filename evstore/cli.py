"""The `evstore` command line."""
import argparse
import os
import sys


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = argparse.ArgumentParser(prog="evstore", description="Incremental-checkpoint online learning for TensorFlow.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small EV model on a synthetic click stream")
    demo.add_argument("--steps", type=int, default=2000)
    demo.add_argument("--batch-size", type=int, default=512)
    demo.add_argument("--dim", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from evstore import demo as demo_mod

        first, last = demo_mod.run(steps=args.steps, batch_size=args.batch_size, dim=args.dim, seed=args.seed)
        return 0 if last < first else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
