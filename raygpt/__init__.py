"""raygpt: fault-tolerant GPT-2 pretraining on Ray with llm.c's training infrastructure."""

__version__ = "0.1.0"

# every module logs to logging.getLogger(__name__); this gives the "raygpt" logger its console
from raygpt.runlog import console as _console  # noqa: E402,F401
