"""What more than one eaglet service imports: settings, Redis keys and scripts, file formats."""
