"""serving_loader: stock-TensorFlow serving export, hot checkpoint application, REST server
(docs/ARCHITECTURE.md, "Serving")."""
from serving_loader.export import ensure_serving_export, export_serving_model
from serving_loader.model import ServingModel

__all__ = ["ensure_serving_export", "export_serving_model", "ServingModel"]
