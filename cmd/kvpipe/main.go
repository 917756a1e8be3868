// Command kvpipe is the debugging tool for engine KV-event streams:
//
//	kvpipe decode [--hex] [FILE]   print the events of one payload as JSON lines
//	kvpipe listen --endpoint URL   subscribe to live engines and summarise what arrives
//	kvpipe relay --endpoint URL    publish the engines' index ops to NATS JetStream for routers
//	kvpipe serve --endpoint URL    the index as a service: gRPC, HTTP/JSON, metrics, a status page
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: kvpipe decode|listen|relay|serve [flags]; kvpipe CMD -h for the flags")
		return 2
	}
	switch args[0] {
	case "decode":
		return decodeCmd(args[1:], stdin, stdout, stderr)
	case "listen":
		return listenCmd(ctx, args[1:], stdout, stderr)
	case "relay":
		return relayCmd(ctx, args[1:], stdout, stderr)
	case "serve":
		return serveCmd(ctx, args[1:], stderr)
	}
	fmt.Fprintf(stderr, "kvpipe: unknown command %q (want decode, listen, relay or serve)\n", args[0])
	return 2
}
