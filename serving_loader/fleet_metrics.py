"""What a serving replica of a fleet reports per commit, read from its
ServingModel at each scrape: bytes fetched from the checkpoint root, apply
duration, lag from the commit's time (its manifest's wall_time) to served,
and the precision it serves (docs/guides/serving-fleet.md)."""

__all__ = ["register_metrics"]


class _Collector:
    def __init__(self, model):
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.model
        yield CounterMetricFamily("evstore_serving_fetched_bytes", "Bytes read from the checkpoint root for "
                                  "the checkpoints applied (index, data files and ranges; manifests aside)",
                                  value=m.fetched_bytes_total)
        yield GaugeMetricFamily("evstore_serving_last_commit_fetched_bytes", "Bytes read from the checkpoint "
                                "root for the last applied checkpoint (-1: none yet)",
                                value=-1 if m.last_fetched_bytes is None else m.last_fetched_bytes)
        yield GaugeMetricFamily("evstore_serving_last_commit_apply_seconds", "Stage + publish time of the last "
                                "applied checkpoint (-1: none yet)",
                                value=-1 if m.last_apply_s is None else m.last_apply_s)
        yield GaugeMetricFamily("evstore_serving_last_commit_lag_seconds", "Wall time from the last applied "
                                "checkpoint's commit (its manifest's wall_time) to being served (-1: none yet)",
                                value=-1 if m.last_lag_s is None else m.last_lag_s)
        view = GaugeMetricFamily("evstore_serving_view", "1 for the precision the served rows were read in "
                                 "(float32, or the commit's serving view)", labels=["dtype"])
        if m.serving_view is not None:
            view.add_metric([m.serving_view], 1)
        yield view

    def describe(self):
        return []


def register_metrics(registry, model):
    """Adds the fleet metrics of `model` (a ServingModel) to a prometheus_client registry."""
    registry.register(_Collector(model))
