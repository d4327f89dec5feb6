"""The live pipeline shared by api and workers: stream names, message codecs, routing."""
