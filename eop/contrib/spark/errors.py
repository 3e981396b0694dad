"""The errors of eop's Spark integration, in the :mod:`eop.errors` hierarchy."""

from __future__ import annotations

from eop import errors


class SparkUnavailable(errors.ConfigurationError):
    """PySpark is missing: install the `spark` extra (`pip install 'eop[spark]'`)."""


class SparkConnectUnavailable(errors.ConfigurationError):
    """Spark Connect's client libraries are missing: install the `spark-connect` extra."""


class RangeUnavailable(errors.EopError):
    """The requested sequences are no longer in the stream: retention or a purge removed them.

    Reading on would return fewer rows than asked for, so eop fails instead.
    """


class StreamRecreated(errors.EopError):
    """The stream was deleted and recreated: its sequences now name other messages."""


class SparkJobFailed(errors.EopError):
    """A Spark job failed."""


class ExecutorsUnready(errors.ConfigurationError):
    """Spark's executors cannot import what the sink needs (eop, pyarrow or the app)."""


class JobStalled(errors.EopError):
    """No task of the Spark job ran for longer than the stall timeout: no executor took it."""


class JobStopped(errors.EopError):
    """SIGTERM or SIGINT stopped the Spark job before it finished: what it committed stays."""


class JobLeaseLost(errors.EopError):
    """The Spark job's lease in PostgreSQL ran out or was taken over: its tasks commit no more."""


class SparkConnectLost(errors.EopError):
    """The Spark Connect server stopped answering (it died, restarted or became unreachable)."""
