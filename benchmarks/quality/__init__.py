"""The quality study: validation loss of acco and dpu against sync on the single-process reference (``cli``)."""
