from mlxpipe.cli import main

main()
