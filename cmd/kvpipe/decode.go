package main

import (
	"bufio"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/kvpipe/kvpipe/codec"
)

func decodeCmd(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("decode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	hexIn := fs.Bool("hex", false, "the input is hex text ('#' starts a comment, white space is ignored)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvpipe decode [--hex] [FILE]  (stdin when FILE is absent or -)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	in := stdin
	if name := fs.Arg(0); name != "" && name != "-" {
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintln(stderr, "kvpipe decode:", err)
			return 1
		}
		defer f.Close()
		in = f
	}
	payload, err := io.ReadAll(in)
	if err == nil && *hexIn {
		payload, err = parseHex(string(payload))
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvpipe decode:", err)
		return 1
	}
	var batch codec.Batch
	if err := codec.NewDecoder().Decode(payload, &batch); err != nil {
		fmt.Fprintln(stderr, "kvpipe decode: bad payload:", err)
		return 1
	}
	w := bufio.NewWriter(stdout)
	var line []byte
	for i := range batch.Events {
		line = appendEventJSON(line[:0], &batch.Events[i])
		w.Write(append(line, '\n'))
	}
	if batch.Skipped > 0 {
		fmt.Fprintf(stderr, "kvpipe decode: skipped %d events with an unknown tag\n", batch.Skipped)
	}
	if err := w.Flush(); err != nil {
		fmt.Fprintln(stderr, "kvpipe decode:", err)
		return 1
	}
	// The events it could not read: each costs only itself, as in a worker.
	for _, err := range batch.Invalid {
		fmt.Fprintln(stderr, "kvpipe decode: unreadable event left out:", err)
	}
	if len(batch.Invalid) > 0 {
		return 1
	}
	return 0
}

func parseHex(text string) ([]byte, error) {
	var digits strings.Builder
	for line := range strings.SplitSeq(text, "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		for _, f := range strings.Fields(line) {
			digits.WriteString(f)
		}
	}
	b, err := hex.DecodeString(digits.String())
	if err != nil {
		return nil, fmt.Errorf("bad hex input: %w", err)
	}
	return b, nil
}
