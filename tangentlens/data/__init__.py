"""Data and training: the corpus, the small models trained here, checkpoint series."""
