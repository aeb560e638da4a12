"""What a run leaves behind and how runs are organised: run folders, config files, sweeps."""
