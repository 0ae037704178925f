"""Background schedules (apscheduler) for periodic saves and polls.

A job runs at most one instance at a time (max_instances=1, coalesce): when a
save or a poll takes longer than its interval the next run is skipped, which
is the intended behaviour. apscheduler reports every such skip as a WARNING
("maximum number of running instances reached"); at a fast poll interval that
fills the log. The schedulers made here log through their own logger, which
demotes those skip reports to DEBUG and counts them (`skipped`).
"""
import logging

__all__ = ["background_scheduler"]

_SKIP = "maximum number of running instances reached"


class _SkipsToDebug(logging.Filter):
    def __init__(self):
        super().__init__()
        self.skipped = 0

    def filter(self, record):
        if record.levelno == logging.WARNING and _SKIP in str(record.msg):
            self.skipped += 1
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def background_scheduler(name):
    """A daemon BackgroundScheduler logging as `evstore.schedule.<name>` with
    skipped runs at DEBUG; its filter's `skipped` counts them."""
    from apscheduler.schedulers.background import BackgroundScheduler
    logger = logging.getLogger(f"evstore.schedule.{name}")
    if not any(isinstance(f, _SkipsToDebug) for f in logger.filters):
        logger.addFilter(_SkipsToDebug())
    return BackgroundScheduler(daemon=True, logger=logger)
