"""One TF gRPC server (a PS or worker task) of bench/cluster/bench_cluster.py's loopback cluster, for TFRA.

    .peer-tfra/bin/python -m bench.cluster.cluster_server --system tfra --job worker --task 1 --cluster cluster.json

(evstore's tasks run evstore's own launcher, `python -m evstore_app server`; `--system
evstore` here does the same job without it.) Imports the system's op library first (`import evstore`, or TFRA's
`dynamic_embedding` module, which registers its kernels), so that the server
can run the ops the chief places on it, then starts
`tf.distribute.Server(ClusterSpec, job, task, protocol="grpc")` and serves
until killed. Prints "ready <job> <task>" on stdout once the server started.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=("evstore", "tfra"), required=True)
    ap.add_argument("--job", choices=("ps", "worker"), required=True)
    ap.add_argument("--task", type=int, required=True)
    ap.add_argument("--cluster", required=True, help="cluster spec JSON file: {job: [host:port, ...]}")
    ap.add_argument("--threads", type=int, default=0, help="intra/inter-op threads (0: TF default)")
    args = ap.parse_args()
    if args.system == "evstore":
        import evstore  # noqa: F401  (loads the op library: the server can run EV kernels)
    else:
        from tensorflow_recommenders_addons import dynamic_embedding  # noqa: F401  (registers TFRA kernels)
    import tensorflow as tf
    config = tf.compat.v1.ConfigProto()
    if args.threads:
        config.intra_op_parallelism_threads = args.threads
        config.inter_op_parallelism_threads = args.threads
    with open(args.cluster) as f:
        spec = json.load(f)
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=args.job,
                                  task_index=args.task, protocol="grpc", config=config, start=True)
    print(f"ready {args.job} {args.task}", flush=True)
    server.join()


if __name__ == "__main__":
    sys.exit(main())
