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
    ckpt = sub.add_parser("ckpt", help="inspect, verify, compact or export a checkpoint root")
    tools = ckpt.add_subparsers(dest="tool", required=True)
    t = tools.add_parser("inspect", help="list committed checkpoints and the chain restore() applies")
    t.add_argument("root", help="checkpoint root: a path or fsspec URL")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t = tools.add_parser("verify", help="check every file against its manifest (size, crc32c) and the chain")
    t.add_argument("root")
    t.add_argument("--seq", type=int, default=None, help="only the chain restore(seq=SEQ) would apply")
    t = tools.add_parser("compact", help="fold the chain into a new full checkpoint (no training)")
    t.add_argument("root")
    t.add_argument("--seq", type=int, default=None, help="fold the chain restore(seq=SEQ) would apply")
    t = tools.add_parser("to-parquet", help="write each EV's rows after the chain as Parquet files")
    t.add_argument("root")
    t.add_argument("out_dir", help="output directory (path or fsspec URL)")
    t.add_argument("--seq", type=int, default=None, help="the state restore(seq=SEQ) would give")
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        from checkpoint import tools as ckpt_tools  # imports TensorFlow: only when needed

        return ckpt_tools.cli(args)
    if args.command == "demo":
        from evstore import demo as demo_mod

        first, last = demo_mod.run(steps=args.steps, batch_size=args.batch_size, dim=args.dim, seed=args.seed)
        return 0 if last < first else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
