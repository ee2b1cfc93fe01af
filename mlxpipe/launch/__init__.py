"""Running a model on the ranks: the launch sequence, the controller's pipeline, mlx.launch and its
processes, the per-rank supervisor, the events' frames and the failure tracker."""
