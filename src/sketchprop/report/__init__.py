"""Tables and figures rebuilt from the files under results/, one module per table or figure."""
