"""Research tools on top of the trainer and the evaluation: ablation grids (`grid`: arms x seeds
-> train -> evaluate -> statistics, resumable; `python -m opsd.research.grid`), the probe of a setting
on frozen rollouts (`probe`, `attribution`; `python -m opsd.research.probe`), and the script that
trains and measures the learned embedded default (`train_tiny_default`;
`python -m opsd.research.train_tiny_default`)."""
