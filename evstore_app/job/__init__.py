"""The streaming online-learning job (docs/ARCHITECTURE.md, "Streaming job"): `evstore demo` and `evstore train`.

The job is the top of the stack: it trains an evstore model on a stream,
saves scheduled deltas and fulls with checkpoint.CheckpointManager, and
(`demo`) runs a separate serving process (serving_loader) that hot-applies
them. It is part of the application package evstore_app, which no library
package imports: evstore_app -> serving_loader -> checkpoint -> evstore.
"""
