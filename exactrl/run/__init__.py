"""What a training run does around its loop: the run context (directory, metric sinks,
progress, evaluation, checkpoint cadence) and evaluation."""
