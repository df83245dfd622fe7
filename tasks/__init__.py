"""The Prefect tasks of the pipeline (one module each). Importing the package makes a fenced task
run's end an INFO line in this process (``log_levels``): every process running one of our tasks."""

from . import log_levels

log_levels.install()
