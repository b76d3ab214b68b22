"""`python -m evaluation CHECKPOINT|RUN_FOLDER|base [options]`: evaluation.evaluate's command line."""
import sys

from evaluation.evaluate import main
from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly

if __name__ == "__main__":
    sys.exit(exit_status(main))
