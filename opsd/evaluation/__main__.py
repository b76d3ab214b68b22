"""`python -m opsd.evaluation CHECKPOINT|RUN_FOLDER|base [options]`: opsd.evaluation.evaluate's command line."""
import sys

from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly
from opsd.evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(exit_status(main))
