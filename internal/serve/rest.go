package serve

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"

	"connectrpc.com/connect"
	"github.com/kvpipe/kvpipe/internal/serve/kvpipev1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// The HTTP/JSON routes speak the proto's JSON mapping (protojson: field
// names in lowerCamelCase or as in the .proto, 64-bit integers as strings
// on output), so a body is the same as over Connect.
func (s *Server) restRoutes(mux *http.ServeMux) {
	rt := &rest{svc: s.svc, maxBytes: s.cfg.MaxMessageBytes}
	mux.HandleFunc("POST /v1/match", rt.restMatch)
	mux.HandleFunc("POST /v1/match/batch", rt.restMatchBatch)
	mux.HandleFunc("GET /v1/workers", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.svc.list(s.svc.guard.holds(r.Header)))
	})
	mux.HandleFunc("GET /v1/watch", rt.restWatch)
	mux.HandleFunc("POST /v1/workers", rt.restRegister)
	mux.HandleFunc("DELETE /v1/workers/{name}", rt.restUnregister)
	mux.HandleFunc("GET /v1/dump", rt.restDump)
	mux.Handle("GET /metrics", promHandler(s.cfg.Registry))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.HandleFunc("GET /{$}", s.page)
}

// rest is the HTTP/JSON face of the service.
type rest struct {
	svc      *service
	maxBytes int // of a request body
}

func (s *rest) restMatch(w http.ResponseWriter, r *http.Request) {
	var req kvpipev1.MatchRequest
	if !s.readJSON(w, r, &req) {
		return
	}
	out, err := s.svc.match(r.Context(), r.Header, &req)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *rest) restMatchBatch(w http.ResponseWriter, r *http.Request) {
	var req kvpipev1.MatchBatchRequest
	if !s.readJSON(w, r, &req) {
		return
	}
	out, err := s.svc.matchBatch(r.Context(), r.Header, &req)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// restWatch streams WatchWorkers as JSON lines (application/x-ndjson), one
// WorkerEvent a line, flushed as each comes: the framing of /v1/dump, read
// line by line by any HTTP client (curl -N, a Python or Rust loop) with no
// event-stream parser, and a router reconnects on its own terms, where
// server-sent events would add a browser's retry and event ids nothing
// here needs. A stream that falls behind, or the server draining, ends it
// with a last line in the error shape ({"code": "resource_exhausted", ...},
// "unavailable"): reconnect.
func (s *rest) restWatch(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	if err := rc.Flush(); err != nil { // headers now: the first change may be long in coming
		return
	}
	err := s.svc.watch(r.Context(), s.svc.guard.holds(r.Header), func(ev *kvpipev1.WorkerEvent) error {
		data, err := marshalJSON(ev)
		if err == nil {
			_, err = w.Write(data)
		}
		if err == nil {
			err = rc.Flush()
		}
		return err
	})
	switch code := connect.CodeOf(err); code {
	case connect.CodeResourceExhausted, connect.CodeUnavailable: // lagged, draining
		body, _ := json.Marshal(errorBody{code.String(), message(err)})
		w.Write(append(body, '\n'))
	}
}

func (s *rest) restRegister(w http.ResponseWriter, r *http.Request) {
	if err := s.svc.guard.authorize(r.Header); err != nil {
		writeError(w, err)
		return
	}
	var req kvpipev1.RegisterWorkerRequest
	if !s.readJSON(w, r, &req) {
		return
	}
	out, err := s.svc.register(r.Context(), req.Worker, false)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, &kvpipev1.RegisterWorkerResponse{Worker: out})
}

func (s *rest) restUnregister(w http.ResponseWriter, r *http.Request) {
	if err := s.svc.guard.authorize(r.Header); err != nil {
		writeError(w, err)
		return
	}
	if err := s.svc.unregister(r.Context(), r.PathValue("name")); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// restDump writes the worker's blocks as JSON lines, one chunk a line.
func (s *rest) restDump(w http.ResponseWriter, r *http.Request) {
	if err := s.svc.guard.authorize(r.Header); err != nil {
		writeError(w, err)
		return
	}
	started := false
	err := s.svc.dump(r.Context(), r.URL.Query().Get("worker"), func(chunk *kvpipev1.DumpResponse) error {
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			started = true
		}
		data, err := marshalJSON(chunk)
		if err == nil {
			_, err = w.Write(data)
		}
		return err
	})
	if err != nil && !started {
		writeError(w, err)
	}
}

// readJSON decodes a request body of at most MaxMessageBytes; a bad one is
// answered 400 with what is wrong.
func (s *rest) readJSON(w http.ResponseWriter, r *http.Request, m proto.Message) bool {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, int64(s.maxBytes)))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		err = invalid("request body larger than the limit of %d bytes (--max-message-bytes)", tooBig.Limit)
	case err != nil:
		err = invalid("request body: %v", err)
	default:
		if err = decodeWithin(data, m, s.svc.limits, countJSON, protojson.Unmarshal); err != nil {
			err = invalid("request body is not a %s in JSON: %v", m.ProtoReflect().Descriptor().Name(), err)
		}
	}
	if err != nil {
		s.svc.guard.refused("invalid_argument")
		writeError(w, err)
		return false
	}
	return true
}

func writeJSON(w http.ResponseWriter, status int, m proto.Message) {
	data, err := marshalJSON(m)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(data)
}

// marshalJSON is protojson's output compacted, one line: protojson varies
// its spacing on purpose, which a person reading curl's output need not see.
func marshalJSON(m proto.Message) ([]byte, error) {
	data, err := protojson.Marshal(m)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	out.Grow(len(data) + 1)
	if err := json.Compact(&out, data); err != nil {
		return nil, err
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// writeError answers with the HTTP status of err's code and a body as
// Connect's: {"code": "invalid_argument", "message": "..."}.
func writeError(w http.ResponseWriter, err error) {
	code, msg := connect.CodeOf(err), message(err)
	w.Header().Set("Content-Type", "application/json")
	if code == connect.CodeUnauthenticated {
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvpipe"`)
	}
	w.WriteHeader(httpStatus(code))
	body, _ := json.Marshal(errorBody{code.String(), msg})
	w.Write(append(body, '\n'))
}

// errorBody is an error as Connect writes it in JSON.
type errorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// message is err's text without the code Connect prefixes to it.
func message(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

func httpStatus(c connect.Code) int {
	switch c {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return http.StatusBadRequest
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeFailedPrecondition, connect.CodeAborted:
		return http.StatusConflict
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeCanceled:
		return 499 // as Connect maps it: the client went away
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}
