"""serving_loader: stock-TensorFlow serving export, hot checkpoint application, REST server
(docs/ARCHITECTURE.md, "Serving")."""
from serving_loader.export import export_serving_model
from serving_loader.model import ServingModel

__all__ = ["export_serving_model", "ServingModel"]
