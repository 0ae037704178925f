"""serving_loader: stock-TensorFlow serving export, hot checkpoint application, REST server (DESIGN section 5)."""
