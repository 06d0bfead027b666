"""reducers: pure folds over the log into timelines, trajectories, samples, groups and metrics."""
