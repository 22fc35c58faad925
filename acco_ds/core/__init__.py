"""ACCO itself: buffers, schedule, communication executor, pipeline and reference. No DeepSpeed import."""
