"""Is this machine's install the one the project pins (requirements-gpu.txt on a GPU install,
the stack that ran; requirements.txt on a CPU one)?

    python checks/check_gpu_stack.py [--cpu | --gpu | REQUIREMENTS]

The check itself is opsd/gpu_stack.py, installed with the project as `opsd doctor`; this file
keeps the command the notes and the GPU scripts use.
"""
import sys

from opsd.cli import exit_status  # a reader that stops early (| head) ends it quietly
from opsd.gpu_stack import main

if __name__ == "__main__":
    sys.exit(exit_status(lambda: main(prog="python checks/check_gpu_stack.py")))
