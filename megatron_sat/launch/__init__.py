"""Launching at scale: the ``launch`` config section, the resolved plan (dry-run), rank
discovery for mpirun, and the torchrun / sbatch / mpirun script renderers.

Kept import-light: nothing here imports torch or megatron-core, so the dry-run runs on a login
node."""
