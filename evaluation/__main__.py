"""`python -m evaluation CHECKPOINT|RUN_FOLDER|base [options]`: evaluation.evaluate's command line."""
import sys

from evaluation.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
