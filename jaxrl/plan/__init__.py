"""`jaxrl plan`: compile one RL step of a recipe ahead of time for a TPU topology or the attached GPUs, and
report its per-chip memory, FLOPs, collective traffic, a roofline time estimate and whether it fits."""
