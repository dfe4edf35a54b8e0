"""The data layer: the dataset format on disk (writer, reader, manifest, card), its checks, and the commands
that turn datasets into datasets (import, filter, merge, reward). Nothing here loads a model to sample."""
