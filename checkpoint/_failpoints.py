"""Crash-test hooks: with EVSTORE_FAILPOINT=<point> a saving process stops at
that point, after creating $EVSTORE_FAILPOINT_FILE, until it is killed; with
EVSTORE_FAILPOINT=<point>:raise it raises OSError there (a failed save);
<point>@N stops at the Nth hit of the point in the process, not the first. Unset,
a hit is one dictionary lookup. Points: before-bundle, before-upload (parts
written on every task, none uploaded), before-manifest, after-manifest
(manifest durable, EV snapshots not yet committed); in a task's checkpoint
service (checkpoint/task_service.py), task-before-upload (its part written,
about to upload); the native writer has bundle-mid-data; the Kafka source
(evstore_app/job/kafka_source.py) has kafka-batch-consumed (a batch taken from
the broker, not trained) and before-group-commit (a checkpoint committed, its
offsets not yet sent to the group).
With EVSTORE_FAILPOINT_RELEASE=<path> a stopped process goes on once <path>
exists (a step delayed past another process's action, not killed).
"""
import os
import time

_hits = {}


def hit(point):
    fp = os.environ.get("EVSTORE_FAILPOINT")
    if not fp:
        return
    if "@" in fp and fp.split("@")[0] == point:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] < int(fp.split("@")[1]):
            return
        fp = point
    if fp == point + ":raise":
        raise OSError(f"failpoint {point}: simulated I/O failure")
    if fp == point:
        path = os.environ.get("EVSTORE_FAILPOINT_FILE")
        if path:
            with open(path, "w") as f:
                f.write(point)
        release = os.environ.get("EVSTORE_FAILPOINT_RELEASE")
        while not (release and os.path.exists(release)):
            time.sleep(0.2)
