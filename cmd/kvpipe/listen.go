package main

import (
	"fmt"
	"io"
)

func listenCmd(args []string, stdout, stderr io.Writer) int {
	fmt.Fprintln(stderr, "kvpipe listen: not built yet")
	return 2
}
