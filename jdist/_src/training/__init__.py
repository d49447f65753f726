"""What a training loop keeps and shows: state, checkpoints, iterator positions, preemption,
progress, and TF's distribution-aware loss scaling."""
