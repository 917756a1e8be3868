package opstream

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestTokens(t *testing.T) {
	names := []string{"engine-0", "A_b-9", "a.b", "a b", "*", ">", "x.>", "ünïcode", "~", "~ZW5n", "=", "a/b", "\x00"}
	seen := map[string]string{}
	for _, name := range names {
		tok := Token(name)
		if !plainRe.MatchString(strings.TrimPrefix(tok, "~")) {
			t.Errorf("Token(%q) = %q: not [A-Za-z0-9_-] after the marker", name, tok)
		}
		if prev, dup := seen[tok]; dup {
			t.Errorf("%q and %q share token %q", prev, name, tok)
		}
		seen[tok] = name
		back, err := workerOf(tok)
		if err != nil || back != name {
			t.Errorf("workerOf(Token(%q)) = %q, %v", name, back, err)
		}
	}
	if Token("engine-0") != "engine-0" {
		t.Error("a plain name is not its own token")
	}
	// Tokens Token never makes are refused, so no subject maps to two names.
	for _, tok := range []string{"", "~", "~!!", "~ZW5naW5lLTA", "a.b", "a*"} {
		if name, err := workerOf(tok); err == nil {
			t.Errorf("workerOf(%q) = %q, want an error", tok, name)
		}
	}
	s, _ := Settings{}.WithDefaults()
	if got := s.Subject("a.b"); got != "kvpipe.ops.~YS5i" {
		t.Errorf("Subject(a.b) = %q", got)
	}
	if w, err := WorkerOfSubject(s.Prefix, "kvpipe.ops.~YS5i"); err != nil || w != "a.b" {
		t.Errorf("workerOfSubject = %q, %v", w, err)
	}
	for _, subj := range []string{"kvpipe.ops", "kvpipe.ops.a.b", "other.a", "kvpipe.opsx.a"} {
		if _, err := WorkerOfSubject(s.Prefix, subj); err == nil {
			t.Errorf("WorkerOfSubject(%q): no error", subj)
		}
	}
}

func TestSettingsDefaultsAndErrors(t *testing.T) {
	s, err := Settings{}.WithDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if s.Prefix != DefaultPrefix || s.Stream != DefaultStream || s.Bucket != DefaultBucket || s.Object != DefaultObject ||
		s.Duplicates != DefaultDuplicates || s.MaxAge != DefaultMaxAge || s.MaxBytes != DefaultMaxBytes || s.Replicas != 1 {
		t.Errorf("defaults: %+v", s)
	}
	cfg := s.StreamConfig()
	if cfg.Subjects[0] != "kvpipe.ops.>" || cfg.Storage != jetstream.FileStorage || cfg.Discard != jetstream.DiscardOld ||
		cfg.MaxMsgs != -1 || cfg.Duplicates != DefaultDuplicates {
		t.Errorf("stream config: %+v", cfg)
	}
	for _, bad := range []Settings{
		{Prefix: "a..b"}, {Prefix: "a.*"}, {Prefix: "a.>"}, {Prefix: "a b"},
		{Stream: "A.B"}, {Stream: "A B"}, {Bucket: "a.b"}, {Bucket: "a b"},
		{Duplicates: time.Hour, MaxAge: time.Minute}, {MaxBytes: -1},
	} {
		if _, err := bad.WithDefaults(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}
